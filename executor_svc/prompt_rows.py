"""The logits of the rows that predict prompt tokens, a slice at a time.

A step asking for prompt logprobs computes up to max-num-batched-tokens such rows; their
logits at once ([P, vocab], 400 MB at 2,048 x 49k in float32, more than the GPU memory profile
counts) would be the step's largest tensor. So the model keeps the sampling rows' logits only,
a hook keeps the decoder's last hidden state ([T, hidden]), and the output projection runs on
the prompt rows a slice at a time (prompt_logprobs.py). That is exactly the model's own last
step where the CausalLM head is the projection alone; a model whose head scales or caps its
logits (a config with final_logit_softcapping, logit_scale, logits_scaling) keeps its prompt
rows in the model's logits instead.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import PreTrainedModel

# Config fields of heads that do more than project (Gemma's soft cap, Cohere's and Granite's
# scales): their prompt rows go through the model's own head.
HEAD_POST_PROCESSING = ("final_logit_softcapping", "logit_scale", "logits_scaling")

RowLogits = Callable[[int, int], torch.Tensor]  # (first, end) -> [end - first, V]


class PromptRows:
    """Captures the decoder's last hidden state while armed."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.head = model.get_output_embeddings()
        config = model.config
        plain = not any(getattr(config, name, None) not in (None, 1, 1.0)
                        for name in HEAD_POST_PROCESSING)
        self.enabled = plain and self.head is not None
        self._hidden: torch.Tensor | None = None
        self._armed = False
        if self.enabled:
            model.get_decoder().register_forward_hook(self._capture)

    def _capture(self, module: object, args: object, output: object) -> None:
        if self._armed:
            self._hidden = output.last_hidden_state[0]  # type: ignore[attr-defined]  # [T, H]

    def arm(self) -> None:
        self._armed, self._hidden = True, None

    def row_logits(self, rows: torch.Tensor) -> RowLogits:
        """After the forward: the logits of `rows` (indices into the step's tokens), by slice."""
        assert self._hidden is not None, "the decoder's hidden state was not captured"
        hidden, self._hidden, self._armed = self._hidden[rows], None, False  # [P, H]
        head = self.head

        def logits(first: int, end: int) -> torch.Tensor:
            with torch.inference_mode():
                return head(hidden[None, first:end])[0]  # type: ignore[misc]

        return logits
