"""The tokenizer, loaded offline from the model preset directory (AutoTokenizer)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from common.errors import InvalidArgument
from common.model_dirs import TOKENIZER_FILES, ModelDir, missing_model_message
from gateway.text.token_bound import TokenBound, token_bound


class TokenizerLoadError(RuntimeError):
    """The gateway cannot start: the message names the directory and the remedy."""


CHAT_ROLES = ("system", "user", "assistant", "tool")


@dataclass(frozen=True, slots=True)
class ChatTurn:
    role: str
    content: str
    # An assistant's tool calls ({"id", "type", "function": {"name", "arguments": dict}}),
    # and a tool turn's answer to one (its id), as chat templates read them.
    tool_calls: tuple[dict[str, Any], ...] = ()
    tool_call_id: str | None = None

    def message(self) -> dict[str, Any]:
        message: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            message["tool_calls"] = list(self.tool_calls)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


@dataclass(frozen=True, slots=True)
class Tokenizer:
    hf: Any  # transformers.PreTrainedTokenizerBase
    # NOTE: the Rust tokenizer decodes ~3x faster than the transformers wrapper (3 vs 11 us
    # a call, twice per token per step); used when the wrapper adds no clean-up of its own.
    fast: Any = None
    # The fewest tokens a text can be, known before tokenizing it (token_bound.py; None: this
    # tokenizer's rules do not show one sound).
    bound: TokenBound | None = None

    @classmethod
    def load(cls, path: str, chat_template: str | None = None) -> Tokenizer:
        """`chat_template`: a Jinja file in place of the model's own template."""
        from transformers import AutoTokenizer

        if not Path(path).is_dir():
            raise TokenizerLoadError(missing_model_message("--model", path))
        if not ModelDir.inspect(path).has_tokenizer:
            raise TokenizerLoadError(
                f"no tokenizer in {path} (looked for {', '.join(TOKENIZER_FILES)}): point "
                "--model at the directory that holds the model's tokenizer files"
            )
        try:
            hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except (OSError, ValueError) as exc:
            raise TokenizerLoadError(f"cannot load the tokenizer in {path}: {exc}") from exc
        if chat_template is not None:
            try:
                hf.chat_template = Path(chat_template).read_text()
            except OSError as exc:
                raise TokenizerLoadError(f"--chat-template {chat_template}: {exc}") from exc
        backend = getattr(hf, "backend_tokenizer", None)
        plain = not getattr(hf, "clean_up_tokenization_spaces", False)
        return cls(hf=hf, fast=backend if plain else None, bound=token_bound(backend))

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.hf.eos_token_id
        return () if eos is None else (int(eos),)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:
            return [int(t) for t in self.hf.encode(text, add_special_tokens=add_special_tokens)]
        except Exception as exc:  # noqa: BLE001 - a tokenizer error is the caller's input
            raise InvalidArgument(f"prompt text could not be tokenized: {exc}") from exc

    def render_chat(self, turns: list[ChatTurn]) -> list[int]:
        """Token ids of a conversation in the model's chat template, ready for the reply."""
        return self.encode_rendered(self.chat_text(turns))

    def chat_text(self, turns: list[ChatTurn], add_generation_prompt: bool = True,
                  tools: list[dict[str, Any]] | None = None) -> str:
        """A conversation in the model's chat template, as text (not yet tokenized); with
        `add_generation_prompt`, ready for the reply; `tools` (OpenAI's tool definitions)
        shown to the model by its template."""
        if not turns:
            raise InvalidArgument("chat: messages is empty; send at least one message")
        bad = next((t.role for t in turns if t.role not in CHAT_ROLES), None)
        if bad is not None:
            raise InvalidArgument(f"chat: role {bad!r} is not one of {', '.join(CHAT_ROLES)}")
        if any(t.role == "tool" and t.tool_call_id is None for t in turns):
            raise InvalidArgument(
                "chat: a tool turn answers a tool call: send it over the HTTP API, as a tool "
                "message with its tool_call_id")
        if not getattr(self.hf, "chat_template", None):
            raise InvalidArgument(
                "chat: this model has no chat template; send the prompt as text or token_ids"
            )
        template = str(self.hf.chat_template)
        if tools and "tools" not in template:
            raise InvalidArgument(
                "tools: this model's chat template does not show tools to the model; start "
                "the gateway with --chat-template models/chat_templates/hermes_tools.jinja "
                "(or the model's own template that has them)")
        messages = [t.message() for t in turns]
        try:
            return str(self.hf.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=False,
                **({"tools": tools} if tools else {})))
        except Exception as exc:  # noqa: BLE001 - a template error is the caller's input
            raise InvalidArgument(
                f"chat: the model's template rejected the messages: {exc}"
            ) from exc

    def encode_rendered(self, rendered: str) -> list[int]:
        """Token ids of a rendered chat (chat_text)."""
        # NOTE: the template writes the special tokens itself: encode without adding BOS.
        try:
            return [int(t) for t in self.hf.encode(rendered, add_special_tokens=False)]
        except Exception as exc:  # noqa: BLE001 - a tokenizer error is the caller's input
            raise InvalidArgument(f"chat could not be tokenized: {exc}") from exc

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.fast is not None:
            return str(self.fast.decode(token_ids, skip_special_tokens=skip_special_tokens))
        return str(self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens))
