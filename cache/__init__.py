"""Cache-aware routing: tokens, block hashes, prefix index, routing policies."""

from cache.chat_template import ChatTemplate, ChatTemplateError
from cache.tokenizer import NotConvertible, Tokenizer, build_tiktoken_encoding

__all__ = ["ChatTemplate", "ChatTemplateError", "NotConvertible", "Tokenizer", "build_tiktoken_encoding"]
