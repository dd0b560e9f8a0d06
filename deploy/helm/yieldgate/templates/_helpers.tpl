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

{{/* Engine pod labels of one tier: {{ include "yieldgate.engineSelector" (list $ "standard") }} */}}
{{- define "yieldgate.engineSelector" -}}
{{- $ := index . 0 -}}
{{ include "yieldgate.selectorLabels" $ }}
app.kubernetes.io/component: engine
yieldgate/tier: {{ index . 1 }}
{{- end -}}

{{- define "yieldgate.engineName" -}}
{{- printf "%s-engine-%s" (include "yieldgate.fullname" (index . 0)) (index . 1) -}}
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

{{/* Pod volumes and init container that provide model.path. */}}
{{- define "yieldgate.modelVolume" -}}
- name: model
{{- if .Values.model.demo }}
  emptyDir: {}
{{- else }}
{{ toYaml .Values.model.volume | indent 2 }}
{{- end }}
{{- end -}}

{{- define "yieldgate.demoModelInit" -}}
{{- if .Values.model.demo }}
initContainers:
  - name: demo-model
    image: {{ printf "%s:%s" .Values.engine.image.repository .Values.engine.image.tag | quote }}
    imagePullPolicy: {{ .Values.engine.image.pullPolicy }}
    command: ["yieldgate", "model", "make", "tiny", "--out", {{ .Values.model.path | quote }}]
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
{{- end -}}

{{/* A label map as a selector string, keys sorted: "a=1,b=2". */}}
{{- define "yieldgate.selectorString" -}}
{{- $parts := list -}}
{{- range $k := keys . | sortAlpha -}}
{{- $parts = append $parts (printf "%s=%s" $k (index $ $k)) -}}
{{- end -}}
{{- join "," $parts -}}
{{- end -}}
