"""The prompt's log-probabilities (SamplingParams.prompt_logprobs), from the rows a step
computed for it: the row at position p gives the prompt token at p + 1 its log-probability,
its rank and the most likely tokens'. The rows' logits come a bounded number at a time
(prompt_rows.py): a 2,048-token chunk's over a 49k vocabulary would be 400 MB at once."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from executor_svc.plan import PlannedSeq
from executor_svc.prompt_rows import RowLogits
from executor_svc.step import PromptLogprobs

ROWS_AT_ONCE = 256  # log-softmax rows in memory at a time (~50 MB at a 49k vocabulary)


def prompt_logprobs(row_logits: RowLogits, seqs: Sequence[PlannedSeq]
                    ) -> tuple[PromptLogprobs, ...]:
    """`row_logits(first, end)`: rows [first, end) of the logits of each sequence's
    `prompt_rows()`, in `seqs`' order."""
    targets = [t for planned in seqs for t in _next_tokens(planned)]
    if not targets:
        return ()
    k = max(p.num_prompt_logprobs for p in seqs)
    chosen, ranks, top_ids, top_values = [], [], [], []
    target: torch.Tensor | None = None
    for start in range(0, len(targets), ROWS_AT_ONCE):
        logits = row_logits(start, min(start + ROWS_AT_ONCE, len(targets)))  # [R, V]
        if target is None:
            target = torch.tensor(targets, device=logits.device)
        rows = torch.log_softmax(logits.float(), dim=-1)  # [R, V]
        mine = rows.gather(1, target[start : start + ROWS_AT_ONCE, None])  # [R, 1]
        chosen.append(mine[:, 0])
        ranks.append((rows > mine).sum(dim=-1) + 1)  # [R]
        if k:
            values, ids = torch.topk(rows, min(k, rows.shape[-1]), dim=-1)  # [R, k]
            top_values.append(values)
            top_ids.append(ids)
    logprob_list = torch.cat(chosen).tolist()
    rank_list = torch.cat(ranks).tolist()
    ids_list = torch.cat(top_ids).tolist() if k else []
    values_list = torch.cat(top_values).tolist() if k else []
    out, row = [], 0
    for planned in seqs:
        positions = planned.prompt_rows()
        if not positions:
            continue
        end, n = row + len(positions), planned.num_prompt_logprobs
        tops = tuple(
            tuple(zip(ids_list[r][:n], values_list[r][:n], strict=True)) if n else ()
            for r in range(row, end)
        )
        out.append(PromptLogprobs(planned.work.request_id, positions.start + 1,
                                  tuple(logprob_list[row:end]), tuple(rank_list[row:end]), tops))
        row = end
    return tuple(out)


def _next_tokens(planned: PlannedSeq) -> list[int]:
    positions = planned.prompt_rows()
    prompt = planned.prompt_token_ids or ()
    return list(prompt[positions.start + 1 : positions.stop + 1])
