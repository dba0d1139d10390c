"""Text and tokens with llama.cpp's vocabulary: the chat template, tokenize and detokenize
(a part of harness.engines.llamacpp)."""

from __future__ import annotations

import ctypes
from typing import Any


class LlamaTokens:
    """Text <-> tokens for an engine that holds `_ll`, `_vocab`, its template and a prompt cache."""

    # -- text <-> tokens ------------------------------------------------------------
    def chat(self, text: str) -> str:
        """The model's own Jinja chat template; llama.cpp's built-in matcher if that fails."""
        if self._jinja is not None:
            try:
                return self._jinja.render(text)
            except ValueError:
                self.chat_template_kind = "llama.cpp built-in"
        if self._template_raw is None:
            return text
        ll = self._ll
        msg = (ll.llama_chat_message * 1)()
        msg[0].role = b"user"
        msg[0].content = text.encode()
        size = 4 * len(text) + 4096
        buf = ctypes.create_string_buffer(size)
        n = ll.llama_chat_apply_template(self._template_raw, msg, 1, True, buf, size)
        return buf.raw[:n].decode("utf-8", errors="replace") if 0 <= n <= size else text

    def prompt_tokens(self, text: str) -> list[int]:
        """Chat-formatted, tokenized prompt; cached, since every prompt is run many times."""
        tokens = self._prompt_cache.get(text)
        if tokens is None:
            tokens = self._prompt_cache[text] = self.tokenize(self.chat(text))
        return tokens

    def _special(self, getter: Any) -> str:
        tok = getter(self._vocab)
        return self.detokenize_special([tok]) if tok >= 0 else ""

    def tokenize(self, text: str, special: bool = True) -> list[int]:
        ll = self._ll
        data = text.encode()
        cap = len(data) + 16
        out = (ll.llama_token * cap)()
        n = ll.llama_tokenize(self._vocab, data, len(data), out, cap, special, special)
        if n < 0:
            cap = -n
            out = (ll.llama_token * cap)()
            n = ll.llama_tokenize(self._vocab, data, len(data), out, cap, special, special)
        return list(out[:n])

    def detokenize(self, tokens: list[int]) -> str:
        return self._pieces(tokens, special=False)

    def detokenize_special(self, tokens: list[int]) -> str:
        return self._pieces(tokens, special=True)

    def _pieces(self, tokens: list[int], special: bool) -> str:
        ll = self._ll
        buf = ctypes.create_string_buffer(256)
        pieces = []
        for tok in tokens:
            n = ll.llama_token_to_piece(self._vocab, tok, buf, 256, 0, special)
            pieces.append(buf.raw[: max(n, 0)])
        return b"".join(pieces).decode("utf-8", errors="replace")


    def count_tokens(self, text: str) -> int:
        return len(self.tokenize(text, special=False))
