{{/* Names and labels. */}}
{{- define "yieldgate.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "yieldgate.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else if contains (include "yieldgate.name" .) .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name (include "yieldgate.name" .) | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "yieldgate.selectorLabels" -}}
app.kubernetes.io/name: {{ include "yieldgate.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "yieldgate.labels" -}}
{{ include "yieldgate.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "yieldgate.gatewaySelector" -}}
{{ include "yieldgate.selectorLabels" . }}
app.kubernetes.io/component: gateway
{{- end -}}

{{/*
Engine pod labels of one model's tier: {{ include "yieldgate.engineSelector" (list $ $model "standard") }},
$model an entry of "yieldgate.models". The model label keeps two models' engines apart in every
selector: Deployments, Services (and so their EndpointSlices) and the gateways' discovery.
*/}}
{{- define "yieldgate.engineSelector" -}}
{{- $ := index . 0 -}}
{{ include "yieldgate.selectorLabels" $ }}
app.kubernetes.io/component: engine
yieldgate/model: {{ (index . 1).label }}
yieldgate/tier: {{ index . 2 }}
{{- end -}}

{{- define "yieldgate.secretName" -}}
{{- default (printf "%s-secrets" (include "yieldgate.fullname" .)) .Values.secrets.existingSecret -}}
{{- end -}}

{{- define "yieldgate.redisName" -}}
{{- printf "%s-redis" (include "yieldgate.fullname" .) -}}
{{- end -}}

{{/*
PYTHONHASHSEED of every engine and gateway. vLLM seeds its prefix-cache block-hash chain with it;
the gateway hashes prompt blocks with the same seed (cache/blocks.py, BlockHashConfig.hash_seed),
so cache-aware routing and KV events agree only if every pod uses this one value.
*/}}
{{- define "yieldgate.hashSeed" -}}0{{- end -}}

{{/* The Redis URL for yieldgate.toml; "" when it comes from a Secret instead. */}}
{{- define "yieldgate.redisURL" -}}
{{- if .Values.redis.existingSecret -}}
{{- else if .Values.redis.url -}}
{{- .Values.redis.url -}}
{{- else if .Values.redis.bundled.enabled -}}
{{- printf "redis://%s:6379/0" (include "yieldgate.redisName" .) -}}
{{- end -}}
{{- end -}}

{{- define "yieldgate.gatewayMaxReplicas" -}}
{{- if .Values.gateway.autoscaling.enabled -}}{{ .Values.gateway.autoscaling.maxReplicas }}{{- else -}}{{ .Values.gateway.replicas }}{{- end -}}
{{- end -}}

{{- define "yieldgate.gatewayGracePeriod" -}}
{{- $min := add (int .Values.gateway.drainSeconds) (int .Values.gateway.stopTimeoutSeconds) 10 -}}
{{- $set := int .Values.gateway.terminationGracePeriodSeconds -}}
{{- if eq $set 0 -}}{{ $min }}
{{- else if lt $set (int $min) -}}
{{- fail (printf "gateway.terminationGracePeriodSeconds (%d) must be at least drainSeconds + stopTimeoutSeconds + 10 = %d" $set $min) -}}
{{- else -}}{{ $set }}{{- end -}}
{{- end -}}

{{/* Checks that no schema can make. */}}
{{- define "yieldgate.validate" -}}
{{- $redis := or .Values.redis.existingSecret .Values.redis.url .Values.redis.bundled.enabled -}}
{{- if not $redis -}}
{{- fail "Redis is required (keys, budgets, limits, ledger): set redis.url, redis.existingSecret or redis.bundled.enabled" -}}
{{- end -}}
{{- if and .Values.redis.bundled.enabled (or .Values.redis.url .Values.redis.existingSecret) -}}
{{- fail "redis: choose the bundled instance or an external one (url / existingSecret), not both" -}}
{{- end -}}
{{- $url := include "yieldgate.redisURL" . -}}
{{- if and (gt (int (include "yieldgate.gatewayMaxReplicas" .)) 1) (or (contains "127.0.0.1" $url) (contains "localhost" $url)) -}}
{{- fail "several gateway replicas must share one Redis: redis.url cannot be a loopback address" -}}
{{- end -}}
{{- if not (has .Values.discovery.kind (list "dns" "kubernetes")) -}}
{{- fail (printf "discovery.kind must be dns or kubernetes, not %q" .Values.discovery.kind) -}}
{{- end -}}
{{- if not (has .Values.engine.device (list "cpu" "gpu")) -}}
{{- fail (printf "engine.device must be cpu or gpu, not %q" .Values.engine.device) -}}
{{- end -}}
{{- if and (not .Values.model.demo) (not .Values.model.volume) -}}
{{- fail "model.demo is false: set model.volume to the volume holding model.path" -}}
{{- end -}}
{{- $enabled := list -}}
{{- range $tier, $t := .Values.tiers -}}
{{- if not (has $tier (list "standard" "fast")) -}}
{{- fail (printf "tiers.%s: yieldgate knows the tiers standard and fast" $tier) -}}
{{- end -}}
{{- if $t.enabled -}}{{- $enabled = append $enabled $tier -}}{{- end -}}
{{- end -}}
{{- if not $enabled -}}
{{- fail "enable at least one tier (tiers.standard.enabled / tiers.fast.enabled)" -}}
{{- end -}}
{{- end -}}

{{/*
A pod volume holding model files: (dict "name" "model" "model" $model), $model an entry of
"yieldgate.models": an emptyDir its demo init container fills, or the model's volume.
*/}}
{{- define "yieldgate.modelVolume" -}}
- name: {{ .name }}
{{- if .model.demo }}
  emptyDir: {}
{{- else }}
{{ toYaml .model.volume | indent 2 }}
{{- end }}
{{- end -}}

{{/*
Init containers writing the generated demo model of each listed model that is one into the volume
"model": (dict "models" (list $model ...) "image" $engineImage). Nothing when none is.
*/}}
{{- define "yieldgate.demoModelInit" -}}
{{- $demo := list -}}
{{- range .models }}{{ if .demo }}{{ $demo = append $demo . }}{{ end }}{{ end -}}
{{- if $demo }}
initContainers:
{{- range $demo }}
  - name: {{ ternary "demo-model" (printf "demo-model-%s" .label) .first }}
    image: {{ printf "%s:%s" $.image.repository $.image.tag | quote }}
    imagePullPolicy: {{ $.image.pullPolicy }}
    command: ["yieldgate", "model", "make", "tiny", "--out", {{ .path | quote }}]
    env:
      - {name: HOME, value: /tmp}
      - {name: HF_HUB_OFFLINE, value: "1"}
    securityContext:
      allowPrivilegeEscalation: false
      capabilities: {drop: [ALL]}
    volumeMounts:
      - {name: model, mountPath: /models}
      - {name: tmp, mountPath: /tmp}
{{- end }}
{{- end }}
{{- end -}}

{{/*
Every model the chart serves as YAML {models: [...]}: the first from `model`, then `models`. Each
entry carries what its engines and its gateway config need:
  label       the yieldgate/model label of its engines, and the piece of their names
  path        its files in every pod that reads them (gateways and its engines)
  demo        generated into the /models emptyDir of each such pod (model.demo, no volume of its own)
  volume      else this volume source, mounted read-only at `mount`: model.volume at /models, or
              a volume of its own at /models-<label>
  engine      the chart's `engine`, each key the model gives replacing the chart's
  tiers       the chart's `tiers`, likewise per tier
  engineBase  its engine Deployments and Services are <engineBase>-<tier>
Values no schema can catch fail here.
*/}}
{{- define "yieldgate.models" -}}
{{- $fullname := include "yieldgate.fullname" . -}}
{{- $main := .Values.model -}}
{{- $first := dict "name" $main.name "label" ($main.label | default "") "path" $main.path "blockSize" $main.blockSize
      "fallbackModel" ($main.fallbackModel | default "") "prices" ($main.prices | default dict) "first" true -}}
{{- $keys := list "name" "label" "path" "volume" "blockSize" "fallbackModel" "prices" "engine" "tiers" -}}
{{- $out := list -}}
{{- $names := list -}}
{{- $labels := list -}}
{{- range $i, $m := prepend (.Values.models | default list) $first -}}
{{- $where := ternary "model" (printf "models[%d]" (sub $i 1)) (eq $i 0) -}}
{{- if not (kindIs "map" $m) -}}
{{- fail (printf "%s must be a map with at least a name" $where) -}}
{{- end -}}
{{- range $k, $_ := $m -}}
{{- if and (ne $i 0) (not (has $k $keys)) -}}
{{- fail (printf "%s.%s: unknown key (one of %s)" $where $k (join ", " $keys)) -}}
{{- end -}}
{{- end -}}
{{- if not $m.name -}}
{{- fail (printf "%s.name is required: the model name clients send" $where) -}}
{{- end -}}
{{- if has $m.name $names -}}
{{- fail (printf "%s.name %q: another model has this name" $where $m.name) -}}
{{- end -}}
{{- $names = append $names $m.name -}}
{{- $label := $m.label | default (regexReplaceAll "[^a-z0-9-]+" (lower $m.name) "-" | trimAll "-" | trunc 63 | trimSuffix "-") -}}
{{- if not (regexMatch "^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$" $label) -}}
{{- fail (printf "%s.label %q: lower-case letters, digits and '-', at most 63 (a label value and part of resource names)" $where $label) -}}
{{- end -}}
{{- if has $label $labels -}}
{{- fail (printf "%s: two models would share the label %q; give one a label of its own (%s.label)" $where $label $where) -}}
{{- end -}}
{{- $labels = append $labels $label -}}
{{- $own := and (ne $i 0) (not (empty $m.volume)) -}}
{{- $mount := ternary (printf "/models-%s" $label) "/models" $own -}}
{{- $path := $m.path | default (ternary $mount (printf "/models/%s" $label) $own) -}}
{{- if not (or (eq $path $mount) (hasPrefix (printf "%s/" $mount) $path)) -}}
{{- fail (printf "%s.path %q must be under %s, where its files are mounted" $where $path $mount) -}}
{{- end -}}
{{- $engine := deepCopy $.Values.engine -}}
{{- range $k, $v := ($m.engine | default dict) -}}
{{- if not (hasKey $engine $k) -}}
{{- fail (printf "%s.engine.%s: not a key of `engine`" $where $k) -}}
{{- end -}}
{{- $_ := set $engine $k $v -}}
{{- end -}}
{{- $given := $m.tiers | default dict -}}
{{- range $tier, $_ := $given -}}
{{- if not (hasKey $.Values.tiers $tier) -}}
{{- fail (printf "%s.tiers.%s: yieldgate knows the tiers standard and fast" $where $tier) -}}
{{- end -}}
{{- end -}}
{{- $tiers := dict -}}
{{- $enabled := list -}}
{{- range $tier, $t := $.Values.tiers -}}
{{- $eff := deepCopy $t -}}
{{- range $k, $v := (index $given $tier | default dict) -}}
{{- if not (hasKey $t $k) -}}
{{- fail (printf "%s.tiers.%s.%s: not a key of tiers.%s" $where $tier $k $tier) -}}
{{- end -}}
{{- $_ := set $eff $k $v -}}
{{- end -}}
{{- $_ := set $tiers $tier $eff -}}
{{- if $eff.enabled -}}{{- $enabled = append $enabled $tier -}}{{- end -}}
{{- end -}}
{{- if not $enabled -}}
{{- fail (printf "%s: enable at least one tier (tiers.standard.enabled / tiers.fast.enabled)" $where) -}}
{{- end -}}
{{- $base := ternary (printf "%s-engine" $fullname) (printf "%s-engine-%s" $fullname $label) (eq $i 0) -}}
{{- range $enabled -}}
{{- if gt (len (printf "%s-%s" $base .)) 63 -}}
{{- fail (printf "%s: the engine name %s-%s is longer than 63 characters; shorten %s.label or fullnameOverride" $where $base . $where) -}}
{{- end -}}
{{- end -}}
{{- $prices := $m.prices | default dict -}}
{{- range $tier, $p := $prices -}}
{{- if not (has $tier $enabled) -}}
{{- fail (printf "%s.prices.%s: not an enabled tier of this model" $where $tier) -}}
{{- end -}}
{{- if or (not (kindIs "map" $p)) (not $p.input) -}}
{{- fail (printf "%s.prices.%s needs input (USD per 1M input tokens; cachedInput and output are optional)" $where $tier) -}}
{{- end -}}
{{- range $k, $_ := $p -}}
{{- if not (has $k (list "input" "cachedInput" "output")) -}}
{{- fail (printf "%s.prices.%s.%s: unknown key (input, cachedInput, output)" $where $tier $k) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- $out = append $out (dict "name" $m.name "label" $label "path" $path "mount" $mount
      "demo" (and $main.demo (not $own)) "volume" (ternary $m.volume $main.volume $own)
      "blockSize" ($m.blockSize | default $main.blockSize) "fallbackModel" ($m.fallbackModel | default "")
      "prices" $prices "engine" $engine "tiers" $tiers "enabled" $enabled "engineBase" $base "first" (eq $i 0)) -}}
{{- end -}}
{{- $priced := list -}}
{{- range $out -}}
{{- if and .fallbackModel (or (eq .fallbackModel .name) (not (has .fallbackModel $names))) -}}
{{- fail (printf "model %q: fallbackModel must be another model of this chart (one of %s), not %q" .name (join ", " $names) .fallbackModel) -}}
{{- end -}}
{{- if .prices }}{{ $priced = append $priced .name }}{{ end -}}
{{- end -}}
{{- if $priced -}}
{{- range $m := $out -}}
{{- range $tier := $m.enabled -}}
{{- if not (hasKey $m.prices $tier) -}}
{{- fail (printf "prices: once a model has prices (%s), every model needs them for each of its enabled tiers (they replace yieldgate's default price entry); %q has none for %s" (join ", " $priced) $m.name $tier) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{ toYaml (dict "models" $out) }}
{{- end -}}

{{/* A label map as a selector string, keys sorted: "a=1,b=2". */}}
{{- define "yieldgate.selectorString" -}}
{{- $parts := list -}}
{{- range $k := keys . | sortAlpha -}}
{{- $parts = append $parts (printf "%s=%s" $k (index $ $k)) -}}
{{- end -}}
{{- join "," $parts -}}
{{- end -}}
