"""Any OpenAI-compatible server: one already running (`base_url`) or one the harness launches.

Each batch sends the target and its fillers as concurrent `/v1/chat/completions` requests (the
server applies its chat template). What the server returned is recorded, not guessed: token
ids come from the server where it gives them (`token_source: server`), else from the model's
own GGUF vocabulary (`tokenizer`); settings the server did not echo back are listed.
"""

from __future__ import annotations

import base64
import math
import os
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from pydantic import Field, model_validator

from harness.core import native_preload
from harness.core.redaction import is_reference, redact_url
from harness.engines.base import (
    HONOUR,
    BatchOutput,
    Engine,
    EngineOptions,
    Ignore,
    LoadSpec,
    Log,
    Refuse,
    Sampling,
    SequenceOutput,
    Unsupported,
)
from harness.engines.parts.end_of_generation import gguf_end_ids, without_end
from harness.engines.parts.server_process import ManagedServer, free_port, get_json, log_dir, post_concurrently
from harness.models import catalog as models

#: sampling fields every request sets, at the values that leave sampling alone: a server (vLLM, SGLang)
#: fills any field a request omits from the checkpoint's generation_config.json (a repetition penalty,
#: a top-k, a min-p), so a field left out is a setting the experiment did not choose
NEUTRAL_SPEC: dict[str, Any] = {"presence_penalty": 0.0, "frequency_penalty": 0.0}
#: the same for fields outside the OpenAI spec (`neutral_sampling`): vLLM and SGLang's names, and llama-server's
NEUTRAL_EXTRA: dict[str, Any] = {"min_p": 0.0, "repetition_penalty": 1.0, "repeat_penalty": 1.0}
#: the request fields recorded as sent (a row's engine_detail `sampling_sent`)
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "seed", *NEUTRAL_SPEC, *NEUTRAL_EXTRA)


class OpenAIOptions(EngineOptions):
    base_url: str | None = Field(None, description="a running server as OpenAI clients write it, e.g. "
                                 "http://127.0.0.1:8000/v1 (or without /v1, or under a gateway's prefix); "
                                 "user:password@ in it is sent as HTTP Basic auth (write the password as ${NAME} to "
                                 "take it from the environment at run time)")
    launch: list[str] | None = Field(None, description="argument list to start a server; {port} and {model} are filled in")
    host: str = Field("127.0.0.1", description="where a launched server listens")
    health_path: str = Field("/v1/models", description="with launch: GET path that answers 200 when the server is ready")
    served_model: str | None = Field(None, description="'model' in requests; default: the model axis value")
    api_key_env: str | None = Field(None, description="name of the environment variable holding an API key (never stored)")
    top_k: bool = Field(True, description="send top_k (not in the OpenAI spec; vLLM, SGLang, llama-server accept it)")
    neutral_sampling: bool = Field(True, description="send min_p 0 and repetition_penalty / repeat_penalty 1 (not in the "
                                   "OpenAI spec; vLLM, SGLang, llama-server accept them), so that a checkpoint's "
                                   "generation_config.json cannot fill them in for a request that omits them")
    startup_timeout_s: float = Field(600, gt=0)
    request_timeout_s: float = Field(600, gt=0)

    @model_validator(mode="after")
    def _one_source(self) -> "OpenAIOptions":
        if (self.base_url is None) == (self.launch is None):
            raise ValueError("give exactly one of base_url (a running server) or launch (a command to start one)")
        if self.base_url is not None and not is_reference(self.base_url) and not self.base_url.startswith(
                ("http://", "https://")):
            raise ValueError(f"base_url '{redact_url(self.base_url)}' must start with http:// or https://")
        if self.base_url is not None and urlsplit(self.base_url).username is not None and self.api_key_env:
            raise ValueError("base_url carries credentials (user:password@) and api_key_env names a key: give one of "
                             "them (a key: api_key_env, sent as 'Authorization: Bearer')")
        return self


class OpenAIEngine(Engine):
    name = "openai"
    Options = OpenAIOptions
    logit_probe_unavailable = "the OpenAI API returns at most 20 top log-probabilities per step, not the logit vector"
    axes = {
        "model": HONOUR,
        "engine": HONOUR,
        "dtype": Refuse("the openai engine cannot choose a dtype; the server's is used (set dtype: auto)"),
        "gpu": HONOUR,
        "batch_invariant": Refuse("the openai engine cannot switch a server's batch-invariant mode; launch the server "
                                  "with it and say so in 'model'"),
        "batch_size": HONOUR,
        "seed": HONOUR,
        "temperature": HONOUR,
        "top_p": HONOUR,
        "top_k": Ignore("engine_options.openai.top_k: false sends no top_k, so the server samples without it",
                        when=lambda value, options: value != 0 and not options.get("top_k", True)),
        "prefix_cache": Refuse("the OpenAI-compatible API has no per-request prefix-cache control (cold / warm); the "
                               "server's own setting applies: use prefix_cache: off and say how the server was started"),
        "context_tokens": HONOUR,
        "prefill_chunk": Refuse("the openai engine cannot set prefill_chunk per request; start the server with it "
                                "and keep prefill_chunk: auto"),
        "kv_cache_dtype": Refuse("the openai engine cannot set kv_cache_dtype per request; start the server with it "
                                 "and keep kv_cache_dtype: auto"),
        "kv_cache_tokens": Refuse("the openai engine cannot size a server's KV cache per request; start the server with it "
                                  "and keep kv_cache_tokens: 0"),
        "draft_tokens": Refuse("the openai engine cannot turn on speculative decoding per request; start the server with it "
                               "and keep draft_tokens: 0"),
        "filler_tokens": HONOUR,
        "environment": HONOUR,  # the worker's interpreter: any engine runs in another venv
    }
    exits_fast = True  # close() waits for a launched server and frees the vocabulary it read
    #: a server that gives no token ids has its answers tokenized with llama.cpp's vocabulary, in process
    native_package = native_preload.LLAMA_CPP
    replay_unavailable = "a server picks its own tokens: a recorded output cannot be forced through its decode loop from outside"
    install = "nothing to install: it talks to a running OpenAI-compatible server"

    @classmethod
    def probe_summary(cls, facts: dict[str, Any]) -> str:
        return "talks to a running OpenAI-compatible server; nothing to install"

    @classmethod
    def refusal(cls, spec: LoadSpec) -> str | None:
        if spec.gpu == "cpu":
            return ("the openai engine cannot tell or choose where a server computes; start it on the CPU "
                    "yourself and use gpu: any (or a GPU type, to route the cell to such a node)")
        return None

    @classmethod
    def restart_refusal(cls, spec: LoadSpec) -> str | None:
        if spec.options.get("launch") is None:
            return ("boots > 1 restarts the engine for each boot, and the openai engine does not restart a server "
                    "it did not start (base_url); give launch instead, so that every boot starts a fresh server")
        return None

    def __init__(self, spec: LoadSpec, log: Log, base: Path | None = None) -> None:
        self.opts = OpenAIOptions.model_validate(spec.options)
        self.spec = spec
        self.server: ManagedServer | None = None
        self._vocab: Any = None
        self._base = base
        key = os.environ.get(self.opts.api_key_env, "") if self.opts.api_key_env else ""
        self._headers = {"Authorization": f"Bearer {key}"} if key else {}
        if self.opts.launch is not None:
            port = free_port(self.opts.host)
            model_arg = spec.model
            try:
                model_arg = str(models.resolve_gguf(spec.model, base))
            except Exception:  # noqa: BLE001 - not a GGUF: pass the name through
                pass
            args = [a.replace("{port}", str(port)).replace("{model}", model_arg) for a in self.opts.launch]
            self.url = f"http://{self.opts.host}:{port}"
            log(f"launching {args[0]} on {self.url}")
            self.server = ManagedServer(args, self.url + self.opts.health_path, log_dir() / f"openai-server-{port}.log",
                                        self.opts.startup_timeout_s, headers=self._headers)
            self.api = self._api_root(self.url)
        else:
            self.url, basic = _without_credentials(self.opts.base_url.rstrip("/"))
            if basic:
                self._headers = {"Authorization": f"Basic {basic}"}
            self.api = self._api_root(self.url)  # a clear error now, not at the first batch
            log(f"OpenAI-compatible API at {redact_url(self.api)}")
        self.served_model = self.opts.served_model or spec.model
        self.end_ids = self._end_ids()

    def _api_root(self, given: str) -> str:
        """The API root under `given`: `given` itself when GET .../models answers there, else `given` + /v1;
        a RuntimeError naming both when neither does."""
        tried = []
        for root in dict.fromkeys([given] if given.endswith("/v1") else [given, given + "/v1"]):
            try:
                get_json(root + "/models", timeout=30, headers=self._headers)
                return root
            except RuntimeError as exc:
                tried.append(str(exc))
        raise RuntimeError("no OpenAI-compatible API found: " + "; ".join(tried) + ". Give base_url as the API root "
                           "an OpenAI client takes (e.g. http://HOST:PORT/v1)")

    def _end_ids(self) -> frozenset[int] | None:
        """The model's end-of-generation tokens, read from its GGUF when the model names one here
        (a server's ids end with the token that stopped it); None for a model known only by name."""
        try:
            path = models.resolve_gguf(self.spec.model, self._base)
        except Exception:  # noqa: BLE001 - a hub name the server knows: no vocabulary here
            return None
        return gguf_end_ids(path)

    def _token_ids(self, text: str) -> list[int]:
        """Fallback: tokenize the answer with the model's GGUF vocabulary (labelled 'tokenizer')."""
        if self._vocab is None:
            try:
                path = models.resolve_gguf(self.spec.model, self._base)
            except Exception as exc:
                raise RuntimeError(f"the server gave no token ids and no tokenizer is known for '{self.spec.model}'") from exc
            import llama_cpp as ll

            params = ll.llama_model_default_params()
            params.vocab_only = True
            self._vocab_model = ll.llama_model_load_from_file(str(path).encode(), params)
            self._vocab = ll.llama_model_get_vocab(self._vocab_model)
        import llama_cpp as ll

        data = text.encode()
        out = (ll.llama_token * (len(data) + 8))()
        n = ll.llama_tokenize(self._vocab, data, len(data), out, len(data) + 8, False, False)
        return list(out[: max(n, 0)])

    def generate(
        self, prompts: list[str], target: int, sampling: Sampling, observe: Any = None, cache: str = "off",
        members: bool = False,
    ) -> BatchOutput:
        if cache != "off":
            raise Unsupported(f"prefix_cache {cache}: the OpenAI-compatible API has no per-request prefix-cache "
                              "control; the server's own setting applies (run it as 'off' and say in the "
                              "experiment how the server was started)")
        if self.server is not None and not self.server.alive():
            raise RuntimeError(f"the launched server died: {self.server.log_tail()}")
        bodies = []
        for i, text in enumerate(prompts):
            body: dict[str, Any] = {
                "model": self.served_model,
                "messages": [{"role": "user", "content": text}],
                "max_tokens": sampling.max_tokens,
                "temperature": sampling.temperature,
                "top_p": sampling.top_p,
                "logprobs": True,
                "top_logprobs": 2,
            }
            seed = sampling.seed_for(i, target)
            if seed is not None:
                body["seed"] = seed
            if self.opts.top_k:
                body["top_k"] = sampling.top_k if sampling.top_k > 0 else -1
            body |= NEUTRAL_SPEC | (NEUTRAL_EXTRA if self.opts.neutral_sampling else {})
            bodies.append(body)
        sent = post_concurrently(self.api + "/chat/completions", bodies, self.opts.request_timeout_s,
                                 headers=self._headers)
        answers, spans, wall = sent.answers, sent.spans, sent.wall_s
        answer = answers[target]
        # with members, each answer is read once (a tokenizer may be asked for its ids)
        read = [self._sequence(a) for a in answers] if members else []
        target_out, source, missing = read[target] if members else self._sequence(answer)
        usage = answer.get("usage", {})
        return BatchOutput(
            target=target_out,
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            prefill_s=None,
            ttft_s=None,
            target_s=spans[target][1] - spans[target][0],
            wall_s=wall,
            batch_generated_tokens=sum(int(a.get("usage", {}).get("completion_tokens", 0)) for a in answers),
            members=[r[0] for r in read] if members else [],
            detail={
                "token_source": source,
                "requests_overlapped": sent.overlapped,
                "release_spread_s": round(sent.release_spread_s, 6),
                "system_fingerprint": answer.get("system_fingerprint"),
                "server_model": answer.get("model"),
                "not_returned": missing,
                # every sampling field the request set: what the server was told, not what it may fill in
                "sampling_sent": {k: v for k, v in bodies[target].items() if k in SAMPLING_FIELDS},
            },
        )

    def _sequence(self, answer: dict[str, Any]) -> tuple[SequenceOutput, str, list[str]]:
        """One chat completion as an output, where its token ids came from, and what the server left out."""
        choice = answer["choices"][0]
        text = choice.get("message", {}).get("content") or ""
        steps = (choice.get("logprobs") or {}).get("content") or []
        missing = [k for k in ("logprobs",) if not steps]
        if steps and all("id" in s for s in steps):
            ids, source = [int(s["id"]) for s in steps], "server"
        elif steps and all(str(s.get("token", "")).startswith("token_id:") for s in steps):
            ids, source = [int(s["token"].split(":", 1)[1]) for s in steps], "server"
        else:
            ids, source = self._token_ids(text), "tokenizer"
        chosen = [float(s.get("logprob", math.nan)) for s in steps]
        margins = [float(s["top_logprobs"][0]["logprob"] - s["top_logprobs"][1]["logprob"])
                   if len(s.get("top_logprobs", [])) >= 2 else math.nan for s in steps]
        finish = str(choice.get("finish_reason"))
        ids, pieces = without_end(ids, _pieces(steps, len(ids)), self.end_ids, finish == "stop")
        out = SequenceOutput(ids, text, finish, chosen, margins, pieces if len(pieces) == len(ids) else [])
        return out, source, missing

    def describe(self) -> dict[str, Any]:
        version = ""
        try:
            version = str(get_json(self.api.removesuffix("/v1") + "/version", timeout=5,
                                   headers=self._headers).get("version", ""))
        except RuntimeError:
            pass
        return {"engine_version": f"openai-compatible {version}".strip(), "url": redact_url(self.url),
                "api_root": redact_url(self.api),
                "launched": self.server is not None,
                "model_sha256": self._model_identity(),
                "chat_template": "the server's own (not seen by the harness)"}

    def _model_identity(self) -> str:
        """The GGUF's sha256 where the model names a file here; else the served name, said to be unverified."""
        try:
            return models.file_sha256(models.resolve_gguf(self.spec.model, self._base))
        except Exception:  # noqa: BLE001 - a name only the server knows
            return f"unverified served model:{self.served_model}"

    def close(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        if self._vocab is not None:
            import llama_cpp as ll

            ll.llama_model_free(self._vocab_model)
            self._vocab = None



def _without_credentials(url: str) -> tuple[str, str]:
    """`url` without user:password@, and those as an HTTP Basic credential ('' when there are none):
    no request goes to a host name built from them."""
    parts = urlsplit(url)
    if parts.username is None:
        return url, ""
    host = parts.hostname or ""
    netloc = (f"[{host}]" if ":" in host else host) + (f":{parts.port}" if parts.port else "")
    pair = f"{unquote(parts.username)}:{unquote(parts.password or '')}"
    return urlunsplit(parts._replace(netloc=netloc)), base64.b64encode(pair.encode()).decode()


def _pieces(steps: list[dict[str, Any]], n_tokens: int) -> list[str]:
    """Per-token text from the log-probability entries, when they are text and align with the ids."""
    texts = [str(s.get("token", "")) for s in steps]
    if len(texts) != n_tokens or any(t.startswith("token_id:") for t in texts):
        return []
    return texts


ENGINE = OpenAIEngine
