"""Cache-aware routing: tokens, block hashes, prefix index, routing policies.

Per request (see cache.routing): tokenize only if ``router.needs_tokens``,
``router.pick(RouteRequest(...), replicas)``, then ``router.sent``, ``first_token`` and ``done`` as the request goes.
"""

from .blocks import BlockHash, BlockHashConfig, BlockHasher, lora_extra_keys, pack_tokens
from .chat_template import ChatTemplate, ChatTemplateError
from .kv_events import (
    AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, KVEventPublisher, KVEventSubscriber,
    KVEventSubscriberConfig, decode_batch,
)
from .policies import (
    PipelineSpec, WeightedScorer, register_filter, register_picker, register_preset, register_scorer,
)
from .prefix_index import IndexStats, PrefixIndex, PrefixIndexConfig, SharedPrefixIndex
from .routing import (
    POLICIES, NoCandidates, Policy, RouteDecision, Router, RouterConfig, UnknownPolicy, build_policy,
)
from .scorers import AdapterCandidacy, Candidate, RouteRequest, adapter_candidacy, load_of, rendezvous
from .tokenizer import NotConvertible, Tokenizer, build_tiktoken_encoding

__all__ = [
    "AdapterCandidacy", "AllBlocksCleared", "BlockHash", "BlockHashConfig", "BlockHasher", "BlockRemoved", "BlockStored",
    "Candidate", "ChatTemplate", "ChatTemplateError", "IndexStats", "KVEventBatch", "KVEventPublisher", "KVEventSubscriber",
    "KVEventSubscriberConfig", "NoCandidates", "NotConvertible", "POLICIES", "Policy", "PrefixIndex",
    "PrefixIndexConfig", "RouteDecision", "RouteRequest", "Router", "RouterConfig", "SharedPrefixIndex",
    "Tokenizer", "UnknownPolicy", "adapter_candidacy", "build_policy", "build_tiktoken_encoding", "decode_batch", "load_of",
    "lora_extra_keys", "pack_tokens", "rendezvous", "PipelineSpec", "WeightedScorer", "register_filter", "register_picker",
    "register_preset", "register_scorer",
]
