"""A model's own chat template, rendered the way llama-server's --jinja renders it.

Engines that apply a template themselves (llama.cpp through llama-cpp-python) use it, so that a
prompt reaches every engine as the same text.
"""

from __future__ import annotations


class ChatTemplate:
    """A model's own (Jinja) chat template, compiled once, rendered per user message.

    This is what llama-server does with --jinja; rendering fails with ValueError, and the
    caller decides the fallback.
    """

    def __init__(self, source: str, bos_token: str = "", eos_token: str = "") -> None:
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise ValueError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        self._errors = (jinja2.TemplateError,)
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template does not compile: {exc}") from exc
        self._special = {"bos_token": bos_token, "eos_token": eos_token}

    def render(self, text: str) -> str:
        try:
            return self._template.render(
                messages=[{"role": "user", "content": text}], add_generation_prompt=True, **self._special
            )
        except self._errors as exc:
            raise ValueError(f"chat template failed: {exc}") from exc
