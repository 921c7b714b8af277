"""A request's prefix-cache block hashes, computed in the router as the model's engine will.

Precise placement needs, per request, the hashes vLLM keys the prompt's KV blocks by
(`kvcache/blockhash.py`): token ids from the model's tokenizer and chat template, the
engine's block size, hash algorithm and NONE_HASH seed, the request's `cache_salt` on block
0 and its LoRA adapter (name, path) on every block. The router cannot mount the model's
volumes, so a pod describes all of it (`GET /internal/prefix-cache`, `kvcache/describe.py`);
`fetch_hasher` reads that description and the tokenizer files (cached by content hash) and
builds a `PromptHasher`, whose `hashes(path, body, tenant)` parses the request as the pod's
route will and returns the prompt's full-block hashes as vLLM's KV events carry them.

What the pod does, mirrored:

* vLLM's OpenAI chat (`vllm/renderers`): each message's text parts joined with "\\n" (the
  "string" content format) or kept as `{"type": "text"}` parts ("openai"), then
  `apply_chat_template(conversation, chat_template=<the one vLLM resolved>, tokenize=True,
  add_generation_prompt=..., continue_final_message=..., documents=None,
  reasoning_effort=None)`;
* vLLM's completions: the prompt text encoded with `add_special_tokens` (default true), or
  the prompt's token ids as sent;
* vLLM's Responses (`responses/utils.py: construct_input_messages`): `instructions` (when
  not empty) as a system message, then `input` as one user message, or its message items
  (`input_text` parts are text parts), rendered as a chat and, unlike a chat, encoded with
  the tokenizer's special tokens (its `TokenizeParams` keep `add_special_tokens` true);
* vLLM's Anthropic Messages (`anthropic/serving.py: to_chat_completion_request`): the
  `system` text (its non-empty text blocks joined with "", Claude Code's billing-header
  block dropped) as a system message, then each message's text (one non-empty text block
  as a string, several as text parts), rendered as a chat;
* our `/v1/stream` on vLLM (`engine/vllm_engine.py: prepare`): a prompt encoded with special
  tokens, messages rendered with the tokenizer's own template and encoded without;
* the simulator: the prompt's (or the messages' joined) whitespace words, each
  `crc32(word) & 0x7FFF` (`engine/simulator.py`), for every route.

`hashes` returns None for what it cannot reproduce exactly, and the caller then places the
request without the cache: an unknown route, a body that does not parse, several prompts,
multimodal or non-text content, tools or a tool choice, a request's own chat template or
template arguments, reasoning or thinking options, messages with tool calls or reasoning,
Responses items other than plain messages (or an assistant item with parts, a partial
one), `previous_response_id`, truncation, Anthropic system messages inside `messages`
(vLLM may merge them into the leading one, by what the template accepts), and
`kv_transfer_params`.

`transformers` is imported only for a vLLM model's tokenizer (not for the simulator), and
through the tokenizer class's own module: `transformers.AutoTokenizer` imports torch.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib
import json
import zlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, cast

import httpx

from ..core.auth.cachesalt import cache_salt_for, check_client_salt
from ..kvcache import blockhash, describe
from .segments import SegmentEncoder

DESCRIPTION_PATH = "/internal/prefix-cache"
Route = Literal["chat", "completion", "responses", "messages", "stream"]
ROUTES: dict[str, Route] = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "completion",
    "/v1/responses": "responses",
    "/v1/messages": "messages",
    "/v1/stream": "stream",
}


def route_of(path: str) -> Route | None:
    """The generating route a request path names; a model served under a path prefix
    (`spec.exposure` ingress path, e.g. `/mistral/v1/chat/completions`) reaches the
    router with the prefix, which its pod strips (transport/prefix.py)."""
    route = ROUTES.get(path)
    if route is None:
        route = next((r for suffix, r in ROUTES.items() if path.endswith(suffix)), None)
    return route


# vLLM drops a system message's first line when it is Claude Code's changing billing header.
_BILLING_HEADER = "x-anthropic-billing-header"
_CHAT_ROLES = frozenset({"system", "user", "assistant"})
_MESSAGE_KEYS = frozenset({"role", "content", "name"})
# Request fields that change how vLLM renders a chat; a request with any of them is not
# reproduced (None).
_CHAT_UNSURE = ("tools", "chat_template", "chat_template_kwargs", "documents",
                "reasoning_effort", "mm_processor_kwargs", "media_io_kwargs",
                "truncate_prompt_tokens", "prompt_embeds", "kv_transfer_params")  # fmt: skip
_COMPLETION_UNSURE = ("suffix", "echo", "truncate_prompt_tokens", "prompt_embeds",
                      "kv_transfer_params")  # fmt: skip
_RESPONSES_UNSURE = ("reasoning", "previous_response_id", "previous_input_messages", "prompt",
                     "chat_template_kwargs", "mm_processor_kwargs", "media_io_kwargs",
                     "kv_transfer_params")  # fmt: skip
_MESSAGES_UNSURE = ("tools", "tool_choice", "thinking", "output_config", "chat_template_kwargs",
                    "kv_transfer_params")  # fmt: skip
_TEXT_BLOCK_KEYS = frozenset({"type", "text", "cache_control"})


class Unsupported(ValueError):
    """A request whose prompt the router does not reproduce exactly."""


class _Words:
    """The simulator's tokens: whitespace words (`SimulatorEngine.prepare`)."""

    @staticmethod
    def ids(text: str) -> list[int]:
        return [zlib.crc32(w.encode()) & 0x7FFF for w in text.split() or [""]]

    def prompt_ids(self, route: Route, body: dict[str, Any]) -> list[int]:
        if route in ("completion", "stream") and body.get("prompt") is not None:
            prompt = body["prompt"]
            if not isinstance(prompt, str):
                raise Unsupported("the simulator takes a text prompt")
            return self.ids(prompt)
        if route in ("chat", "stream"):
            texts = [_sim_content(m) for m in _list(body.get("messages"))]
        elif route == "responses":
            texts = [] if body.get("instructions") is None else [_str(body["instructions"])]
            inp = body.get("input")
            items = [{"content": inp}] if isinstance(inp, str) else _list(inp)
            texts += [_joined(_dict(i).get("content")) for i in items]
        elif route == "messages":
            system = body.get("system")
            texts = [] if system is None else [_joined(system)]
            texts += [_joined(_dict(m).get("content")) for m in _list(body.get("messages"))]
        else:
            raise Unsupported("no prompt")
        return self.ids("\n".join(texts))


def _sim_content(message: Any) -> str:
    content = _dict(message).get("content")
    if content is None or isinstance(content, str):
        return content or ""
    return "".join(str(_dict(p).get("text", "")) for p in _list(content))


def _joined(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(str(_dict(p).get("text", "")) for p in _list(content))


class _HfTokens:
    """A Hugging Face tokenizer loaded from the pod's files, and the chat template and
    content format vLLM resolved."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str | None,
        content_format: str,
        defaults: dict[str, Any] | None = None,
    ) -> None:
        self.tok = tokenizer
        self.chat_template = chat_template
        self.content_format = content_format
        self.defaults = defaults or {}  # the server's default template arguments
        # A rendered chat encoded segment by segment, segments cached (segments.py); None:
        # the tokenizer's encode is not exact by segments, whole texts are encoded.
        self.segments = SegmentEncoder.of(tokenizer)

    def prompt_ids(self, route: Route, body: dict[str, Any]) -> list[int]:
        if route == "chat":
            return self._chat(body)
        if route == "completion":
            return self._completion(body)
        if route == "stream":
            return self._stream(body)
        if route == "responses":  # its TokenizeParams keep add_special_tokens' default, true
            return self._render(_responses_messages(body), special=True)
        return self._render(_anthropic_messages(body))

    def _chat(self, body: dict[str, Any]) -> list[int]:
        if any(body.get(k) is not None for k in _CHAT_UNSURE):
            raise Unsupported("chat rendering depends on the request")
        add_generation_prompt = body.get("add_generation_prompt", True)
        continue_final = body.get("continue_final_message", False)
        special = body.get("add_special_tokens", False)
        if not all(isinstance(b, bool) for b in (add_generation_prompt, continue_final, special)):
            raise Unsupported("not a boolean")
        return self._render(
            _list(body.get("messages")), add_generation_prompt, continue_final, special
        )

    def _render(
        self,
        messages: list[Any],
        add_generation_prompt: bool = True,
        continue_final: bool = False,
        special: bool = False,
    ) -> list[int]:
        """vLLM's chat rendering of OpenAI chat messages (`renderers/chat_utils.py`): the
        template's text, encoded with or without the tokenizer's special tokens."""
        if self.chat_template is None:
            raise Unsupported("no chat template")
        conversation = [self._message(m) for m in messages]
        if not conversation:
            raise Unsupported("no messages")
        kwargs = dict(
            self.defaults,  # the server's defaults, under what the request decides
            tools=None,
            chat_template=self.chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final,
            documents=None,
            reasoning_effort=None,
        )
        if not special and self.segments is None:
            return list(self.tok.apply_chat_template(conversation, tokenize=True,
                                                     return_dict=False, **kwargs))  # fmt: skip
        text = self.tok.apply_chat_template(conversation, tokenize=False, **kwargs)
        if not special:
            return self._encode(text)
        return list(self.tok.encode(text, add_special_tokens=True))

    def _encode(self, text: str) -> list[int]:
        """A rendered chat's ids, without the tokenizer's special tokens."""
        if self.segments is not None:
            return self.segments.encode(text)
        return list(self.tok.encode(text, add_special_tokens=False))

    def _message(self, message: Any) -> dict[str, Any]:
        m = _dict(message)
        role = m.get("role")
        if role not in _CHAT_ROLES or not _MESSAGE_KEYS.issuperset(m):
            raise Unsupported("a message the router does not render")
        content = m.get("content")
        if content is None:
            texts: list[str] = []
        elif isinstance(content, str):
            texts = [content]
        else:
            texts = []
            for part in _list(content):
                p = _dict(part)
                if p.get("type") != "text" or set(p) != {"type", "text"}:
                    raise Unsupported("non-text content")
                texts.append(_str(p["text"]))
        if role == "system" and any(t.startswith(_BILLING_HEADER) for t in texts):
            raise Unsupported("vLLM rewrites this system message")
        out: dict[str, Any] = {"role": role}
        if self.content_format == "openai":
            out["content"] = [{"type": "text", "text": t} for t in texts]
        else:
            out["content"] = "\n".join(texts)
        if isinstance(m.get("name"), str):
            out["name"] = m["name"]
        return out

    def _completion(self, body: dict[str, Any]) -> list[int]:
        if any(body.get(k) not in (None, False) for k in _COMPLETION_UNSURE):
            raise Unsupported("completion options change the prompt")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, list):
            if not prompt or not all(type(t) is int for t in prompt):
                raise Unsupported("several prompts")
            return list(prompt)
        special = body.get("add_special_tokens", True)
        if not isinstance(prompt, str) or not isinstance(special, bool):
            raise Unsupported("no text prompt")
        return list(self.tok.encode(prompt, add_special_tokens=special))

    def _stream(self, body: dict[str, Any]) -> list[int]:
        """`VllmEngine.prepare`: the tokenizer's own template, messages as validated."""
        if body.get("prompt") is not None:
            return list(self.tok.encode(_str(body["prompt"])))
        messages = []
        for message in _list(body.get("messages")):
            m = _dict(message)
            if set(m) - {"role", "content"} or not isinstance(m.get("content"), str):
                raise Unsupported("a message the router does not render")
            messages.append({"role": m["role"], "content": m["content"]})
        if not messages:
            raise Unsupported("no prompt")
        text = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self._encode(text)


def _responses_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages vLLM makes of a Responses request (`construct_input_messages`),
    for its plain text messages; anything else is Unsupported."""
    if any(body.get(k) is not None for k in _RESPONSES_UNSURE):
        raise Unsupported("Responses options change the prompt")
    if body.get("tools") or body.get("tool_choice") not in (None, "auto", "none"):
        raise Unsupported("tools")
    if body.get("truncation") not in (None, "disabled"):
        raise Unsupported("truncation")
    messages: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None and _str(instructions):
        messages.append({"role": "system", "content": instructions})
    inp = body.get("input")
    if isinstance(inp, str):
        return [*messages, {"role": "user", "content": inp}]
    for item in _list(inp):
        i = _dict(item)
        if not {"type", "role", "content"}.issuperset(i) or i.get("type", "message") != "message":
            raise Unsupported("not a plain message item")
        content = i.get("content")
        if i.get("role") == "assistant":
            if not isinstance(content, str):  # vLLM keeps only the first part's text
                raise Unsupported("an assistant item with parts")
        elif not isinstance(content, str):
            parts = []
            for part in _list(content):
                p = _dict(part)
                if p.get("type") != "input_text" or set(p) != {"type", "text"}:
                    raise Unsupported("non-text content")
                parts.append({"type": "text", "text": _str(p["text"])})
            content = parts
        messages.append({"role": i.get("role"), "content": content})
    return messages


def _anthropic_messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chat messages vLLM makes of an Anthropic Messages request
    (`AnthropicServingMessages.to_chat_completion_request`), for text; anything else is
    Unsupported."""
    if any(body.get(k) is not None for k in _MESSAGES_UNSURE):
        raise Unsupported("Messages options change the prompt")
    system = body.get("system")
    parts: list[str] = []
    if isinstance(system, str):
        parts = [system] if system else []
    elif system is not None:
        for text in _anthropic_texts(system):
            if not text.startswith(_BILLING_HEADER):  # vLLM drops Claude Code's block
                parts.append(text)
    messages: list[dict[str, Any]] = []
    if parts:
        messages.append({"role": "system", "content": "".join(parts)})
    for message in _list(body.get("messages")):
        m = _dict(message)
        if m.get("role") not in ("user", "assistant") or set(m) != {"role", "content"}:
            raise Unsupported("a message the router does not render")
        content = m["content"]
        if not isinstance(content, str):
            texts = _anthropic_texts(content)
            if not texts:
                raise Unsupported("no text")
            content = texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
        messages.append({"role": m["role"], "content": content})
    return messages


def _anthropic_texts(blocks: Any) -> list[str]:
    """The non-empty texts of Anthropic text blocks (vLLM skips empty ones)."""
    texts = []
    for block in _list(blocks):
        b = _dict(block)
        if b.get("type") != "text" or not _TEXT_BLOCK_KEYS.issuperset(b):
            raise Unsupported("a block other than text")
        if _str(b.get("text")):
            texts.append(b["text"])
    return texts


def _dict(x: Any) -> dict[str, Any]:
    if not isinstance(x, dict):
        raise Unsupported("not an object")
    return cast(dict[str, Any], x)


def _list(x: Any) -> list[Any]:
    if not isinstance(x, list):
        raise Unsupported("not an array")
    return x


def _str(x: Any) -> str:
    if not isinstance(x, str):
        raise Unsupported("not a string")
    return x


def load_hf_tokenizer(class_name: str, folder: Path) -> Any:
    """The tokenizer class vLLM loaded (by name, from its own module: never through
    `AutoTokenizer`, which imports torch), from the pod's files."""
    transformers = importlib.import_module("transformers")
    cls = getattr(transformers, class_name, None)
    if cls is None or not hasattr(cls, "from_pretrained"):
        raise ValueError(f"transformers has no tokenizer class {class_name!r}")
    return cls.from_pretrained(str(folder))


class PromptHasher:
    """One model's prompt hashing, as its engine does it (build it with `from_description`)."""

    def __init__(
        self,
        hasher: blockhash.BlockHasher,
        tokens: _Words | _HfTokens,
        loras: Mapping[str, str] | None = None,
    ) -> None:
        self.hasher = hasher
        self.tokens = tokens
        self.loras = dict(loras or {})
        self.memo = blockhash.BlockMemo()  # a shared prefix's blocks are hashed once

    @classmethod
    def from_description(
        cls,
        desc: Mapping[str, Any],
        files_dir: Path | None = None,
        load_tokenizer: Callable[[str, Path], Any] = load_hf_tokenizer,
    ) -> PromptHasher | None:
        """From a pod's `GET /internal/prefix-cache` (and, for a vLLM model, the folder its
        tokenizer files were saved in). None when the pod's hashes cannot be reproduced
        (prefix caching off, a random seed, no tokenizer, chats rendered through Harmony:
        gpt-oss). The server's default template arguments are applied as vLLM applies them."""
        if not desc.get("enabled") or desc.get("none_hash_seed") is None:
            return None
        algo = desc["hash_algo"]
        if algo not in blockhash.HASH_ALGOS:
            return None
        hasher = blockhash.BlockHasher(
            cast(blockhash.HashAlgo, algo), str(desc["none_hash_seed"]), int(desc["block_size"])
        )
        tok = desc.get("tokenizer") or {}
        tokens: _Words | _HfTokens
        if tok.get("kind") == "words":
            tokens = _Words()
        elif tok.get("kind") == "hf" and files_dir is not None:
            if tok.get("chat_rendering", "template") != "template":
                return None  # rendered otherwise than by the template (Harmony): not reproduced
            tokens = _HfTokens(
                load_tokenizer(tok["class"], files_dir),
                tok.get("chat_template"),
                tok.get("content_format", "string"),
                tok.get("default_chat_template_kwargs"),
            )
        else:
            return None
        return cls(hasher, tokens, desc.get("loras"))

    def token_ids(self, path: str, body: bytes) -> tuple[list[int], dict[str, Any]] | None:
        """The prompt's token ids as the pod's route will make them, and the parsed body."""
        route = route_of(path)
        if route is None:
            return None
        try:
            parsed = json.loads(body)
            return self.tokens.prompt_ids(route, _dict(parsed)), parsed
        except (Unsupported, ValueError, TypeError, KeyError):
            return None
        except Exception:  # a chat template raising on these messages: the pod refuses too
            return None

    def hashes(self, path: str, body: bytes, tenant: str | None) -> list[int] | None:
        """The prompt's full-block hashes as vLLM's KV events carry them (low 64 bits), or
        None when the router cannot reproduce them (see the module docstring). `tenant`: the
        tenant part of the pod's `cache_salt` (`core/auth/cachesalt.py`), None when the pod
        salts by no tenant (auth off, or the prefix cache shared across tenants)."""
        got = self.token_ids(path, body)
        if got is None:
            return None
        ids, parsed = got
        try:
            client = check_client_salt(parsed.get("cache_salt"))
        except ValueError:
            return None
        model = parsed.get("model")
        lora = None
        if isinstance(model, str) and model in self.loras:
            lora = blockhash.Lora(model, self.loras[model])
        salt = cache_salt_for(tenant, client, shared=False)
        hashes = self.hasher.block_hashes(ids, cache_salt=salt, lora=lora, memo=self.memo)
        return [blockhash.external(h) for h in hashes]


async def fetch_description(client: httpx.AsyncClient, base_url: str) -> dict[str, Any]:
    """A pod's `GET /internal/prefix-cache` (`base_url`: the pod's, e.g.
    `http://10.0.0.7:8000`); httpx errors propagate, a body that is not an object raises
    ValueError."""
    r = await client.get(base_url + DESCRIPTION_PATH)
    r.raise_for_status()
    desc = r.json()
    if not isinstance(desc, dict):
        raise ValueError("the prefix-cache description is not a JSON object")
    return cast(dict[str, Any], desc)


def description_digest(desc: Mapping[str, Any]) -> str:
    """What tells two descriptions apart: the SHA-256 of its canonical JSON (the tokenizer
    files are in it by their content hash)."""
    raw = json.dumps(desc, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(raw.encode()).hexdigest()


async def hasher_from(
    client: httpx.AsyncClient, base_url: str, desc: Mapping[str, Any], cache_dir: Path
) -> PromptHasher | None:
    """The `PromptHasher` of a pod's description; for a vLLM model its tokenizer files are
    fetched from the pod and saved under `cache_dir/<sha256>/` once per content hash. None
    when the pod's hashes cannot be reproduced; httpx errors propagate."""
    tok = desc.get("tokenizer") or {}
    folder = None
    if tok.get("kind") == "hf":
        digest = str(tok["sha256"])
        if not digest.isalnum():
            raise ValueError(f"not a content hash: {digest!r}")
        folder = cache_dir / digest
        if not (folder / ".complete").exists():
            files: dict[str, bytes] = {}
            for name in tok["files"]:
                if name not in describe.TOKENIZER_FILES:
                    raise ValueError(f"not a tokenizer file: {name!r}")
                f = await client.get(f"{base_url}{DESCRIPTION_PATH}/files/{name}")
                f.raise_for_status()
                files[name] = f.content
            if describe.files_digest(files) != digest:
                raise ValueError("the tokenizer files do not match their content hash")
            await asyncio.to_thread(_save, folder, files)
    return await asyncio.to_thread(PromptHasher.from_description, desc, folder)


async def fetch_hasher(
    client: httpx.AsyncClient, base_url: str, cache_dir: Path
) -> PromptHasher | None:
    """A pod's description and, for a vLLM model, its tokenizer files (`hasher_from`)."""
    return await hasher_from(client, base_url, await fetch_description(client, base_url), cache_dir)


def _save(folder: Path, files: dict[str, bytes]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)
    (folder / ".complete").touch()
