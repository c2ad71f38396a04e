"""One request's logits processors that can change the argmax: min_tokens, logit_bias,
penalties; and its structured output's matcher (grammar.py), whose mask the sampler applies
after them, to all constrained rows at once.

vLLM V1's order: the min_tokens mask and logit_bias, then the repetition penalty (transformers'
RepetitionPenaltyLogitsProcessor, over prompt and generated tokens), then the frequency and
presence penalties (OpenAI's formula, over generated tokens only). The sampler applies
temperature, min_p, top_k and top_p after them, to the rows that do not sample greedily.

Only a request that uses one of them gets a LogitsProcessor (RequestState.processor), so a plain
request costs nothing here. The penalties touch only the ids they concern (index_select /
index_copy_ / index_add_ over the distinct ids seen or generated, kept as tensors that grow
with each new id), not the whole [V] row: dense torch.where over 32,000 logits took ~150 us a
row on CPU, the sparse form a few.

Positions below num_prompt_tokens hold the prompt, the others generated tokens: the token
sampled after position p - 1 is generated token p - num_prompt_tokens. A request that did not
say (num_prompt_tokens 0) has its prompt end where it first samples.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from executor_svc.grammar import GrammarState, generated_part
from executor_svc.step import SamplingParams


@dataclass(slots=True)
class TokenSet:
    """Distinct token ids in arrival order: a set for membership, a tensor for index ops."""

    members: set[int]
    ids: torch.Tensor  # [U] long

    @classmethod
    def empty(cls, device: torch.device) -> TokenSet:
        return cls(members=set(), ids=torch.empty(0, dtype=torch.long, device=device))

    def add(self, token_ids: Sequence[int]) -> None:
        new = [t for t in dict.fromkeys(token_ids) if t not in self.members]
        if new:
            self.members.update(new)
            self.ids = torch.cat((self.ids, _ids(new, self.ids.device)))  # [U + n]


@dataclass(slots=True)
class LogitsProcessor:
    params: SamplingParams
    num_prompt_tokens: int  # 0 until the first sample when the request did not say
    num_tokens: int  # positions held; the next token sampled is at this position
    stop_token_ids: torch.Tensor | None  # [N] long: -inf until min_tokens are generated
    bias_token_ids: torch.Tensor | None  # [B] long
    bias_values: torch.Tensor | None  # [B] float32
    seen: TokenSet | None  # in the prompt or generated (repetition_penalty)
    generated: TokenSet | None  # generated (presence_penalty, frequency_penalty)
    generated_counts: torch.Tensor | None  # [V] float32: times each id was generated
    grammar: GrammarState | None = None  # structured output: fed the generated tokens

    @classmethod
    def create(
        cls, params: SamplingParams, vocab_size: int, device: torch.device,
        grammar: GrammarState | None = None,
    ) -> LogitsProcessor | None:
        """The request's processor; None when none of them is on. `grammar`: the matcher of
        params.structured_output, at the start of the output."""
        if not params.edits_logits:
            return None
        masks = params.min_tokens > 0 and params.stop_token_ids
        bias = params.logit_bias
        counts = bool(params.presence_penalty or params.frequency_penalty)
        return cls(
            params=params,
            num_prompt_tokens=params.num_prompt_tokens,
            num_tokens=0,
            stop_token_ids=_ids(sorted(set(params.stop_token_ids)), device) if masks else None,
            bias_token_ids=_ids([t for t, _ in bias], device) if bias else None,
            bias_values=(
                torch.tensor([b for _, b in bias], dtype=torch.float32, device=device)
                if bias else None
            ),
            seen=TokenSet.empty(device) if params.repetition_penalty != 1.0 else None,
            generated=TokenSet.empty(device) if counts else None,
            generated_counts=(
                torch.zeros(vocab_size, dtype=torch.float32, device=device) if counts else None
            ),
            grammar=grammar,
        )

    def append(self, token_ids: Sequence[int], start_position: int, sample: bool) -> None:
        """The tokens at positions [start_position, start_position + len) are held now;
        `sample`: a token is sampled after them (where an unsaid prompt ends)."""
        end = start_position + len(token_ids)
        if not self.num_prompt_tokens and sample:
            self.num_prompt_tokens = end
        self.num_tokens = end
        if self.seen is not None:
            self.seen.add(token_ids)
        if not self.num_prompt_tokens:
            return
        generated = generated_part(token_ids, start_position, self.num_prompt_tokens)
        if self.grammar is not None:
            self.grammar.consume(generated)
        if generated and self.generated is not None:
            assert self.generated_counts is not None, "generated ids come with their counts"
            self.generated.add(generated)
            ids = _ids(generated, self.generated_counts.device)  # [g]
            ones = torch.ones(ids.shape, dtype=torch.float32, device=ids.device)
            self.generated_counts.index_put_((ids,), ones, accumulate=True)

    @property
    def num_generated(self) -> int:
        return max(self.num_tokens - self.num_prompt_tokens, 0)

    @property
    def hides_stop_tokens(self) -> bool:
        """min_tokens still masks the stop ids (a complete constrained output needs EOS)."""
        return self.stop_token_ids is not None and self.num_generated < self.params.min_tokens

    def apply(self, logits: torch.Tensor) -> None:  # [V] float32, edited in place
        """All but the grammar's mask, which the sampler applies to all rows at once."""
        params = self.params
        if self.hides_stop_tokens:
            assert self.stop_token_ids is not None
            logits.index_fill_(0, self.stop_token_ids, float("-inf"))
        if self.bias_token_ids is not None:
            assert self.bias_values is not None, "bias ids come with their values"
            logits.index_add_(0, self.bias_token_ids, self.bias_values)
        if self.seen is not None:
            penalty, ids = params.repetition_penalty, self.seen.ids
            values = logits.index_select(0, ids)  # [U]
            logits.index_copy_(0, ids, torch.where(values > 0, values / penalty, values * penalty))
        if self.generated is not None:
            assert self.generated_counts is not None, "generated ids come with their counts"
            ids = self.generated.ids
            counts = self.generated_counts.index_select(0, ids)  # [G], each > 0
            delta = counts * -params.frequency_penalty - params.presence_penalty  # [G]
            logits.index_add_(0, ids, delta)


def _ids(token_ids: Sequence[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(token_ids, dtype=torch.long, device=device)
