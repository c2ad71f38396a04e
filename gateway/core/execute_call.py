"""The Execute call of a granted step, built row by row in batch order.

Plain decodes (one token, the sequence's last, no table change, already held by the
executor) go in the executor's compact columns; every other row is a SeqWork with its
tokens, its table change and, on a sequence's first Execute, its whole table and sampling.
A row whose token is a placeholder (depth 2: the batch in flight samples it) goes with
use_sampled_token: the executor puts its own sampled token there.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from common.step_records import BlockCopy
from gateway.core.request_state import Sequence
from gateway.core.step import ExecuteCall, SeqWork, TableDelta


@dataclass(slots=True)
class ExecuteCallBuilder:
    work: list[SeqWork] = field(default_factory=list)
    scheduled: list[tuple[Sequence, int]] = field(default_factory=list)
    # The compact decodes, column by column.
    decode_ids: list[str] = field(default_factory=list)
    decode_tokens: list[int] = field(default_factory=list)
    decode_positions: list[int] = field(default_factory=list)
    use_sampled: list[bool] = field(default_factory=list)
    num_unsampled: int = 0
    decoded: list[tuple[Sequence, int]] = field(default_factory=list)

    def add(self, seq: Sequence, start: int, num: int, delta: TableDelta | None,
            drafts: tuple[int, ...] = ()) -> None:
        """`drafts`: tokens after the row's one for the executor to verify (core/drafts.py)."""
        if not drafts and is_plain_decode(seq, start, num, delta):
            self.add_decode(seq, start)
        else:
            self.work.append(_seq_work(seq, start, num, delta, drafts))
            self.scheduled.append((seq, num))

    def add_decode(self, seq: Sequence, start: int) -> None:
        """A plain decode (is_plain_decode): one row of the compact columns."""
        unsampled = seq.num_placeholders > 0  # the executor has the value: it sampled it
        self.decode_ids.append(seq.seq_id)
        self.decode_tokens.append(0 if unsampled else seq.last_token_id)
        self.decode_positions.append(start)
        self.use_sampled.append(unsampled)
        self.num_unsampled += unsampled
        self.decoded.append((seq, 1))

    def build(self, release_ids: list[str], swap_out: tuple[BlockCopy, ...],
              swap_in: tuple[BlockCopy, ...], copies: tuple[BlockCopy, ...]) -> ExecuteCall:
        return ExecuteCall(
            release_request_ids=tuple(release_ids),
            swap_out=swap_out,
            swap_in=swap_in,
            copies=copies,
            seqs=tuple(self.work),
            decode_request_ids=tuple(self.decode_ids),
            decode_token_ids=tuple(self.decode_tokens),
            decode_positions=tuple(self.decode_positions),
            decode_use_sampled_token=tuple(self.use_sampled) if self.num_unsampled else (),
        )

    @property
    def rows(self) -> list[tuple[Sequence, int]]:
        """(sequence, tokens) in batch order: the compact decodes first, then `work`'s."""
        return [*self.decoded, *self.scheduled]


def is_plain_decode(seq: Sequence, start: int, num: int, delta: TableDelta | None) -> bool:
    """One token, the sequence's last, sampled; no table change; the executor holds it."""
    return (
        num == 1 and delta is None and seq.known_to_executor and not seq.is_prefill_parent
        and start + 1 == seq.num_tokens
    )


def _seq_work(seq: Sequence, start: int, num: int, delta: TableDelta | None,
              drafts: tuple[int, ...] = ()) -> SeqWork:
    first = not seq.known_to_executor
    seq.known_to_executor = True
    # A placeholder is the sequence's last token: a row that reaches it is that one token.
    unsampled = seq.num_placeholders > 0 and start + num == seq.num_tokens
    assert not unsampled or num == 1, f"{seq.seq_id}: a placeholder inside a row"
    assert not first or not unsampled, f"{seq.seq_id}: a placeholder sent to a new executor"
    return SeqWork(
        request_id=seq.seq_id,
        token_ids=(0,) if unsampled else (*seq.token_slice(start, start + num), *drafts),
        start_position=start,
        delta=_first_table(seq, delta) if first else delta,
        sample=not seq.is_prefill_parent and start + num == seq.num_tokens,
        sampling=seq.exec_sampling() if first else None,
        use_sampled_token=unsampled,
        num_draft_tokens=len(drafts),
    )


def _first_table(seq: Sequence, delta: TableDelta | None) -> TableDelta:
    """The whole table of a sequence new at the executor: a forked child's from the Fork
    response, with this step's change applied; any other's first grant starts at 0."""
    if seq.fork_table is None:
        assert delta is not None and delta.start_index == 0, (
            f"{seq.seq_id}: new at the executor without its whole table"
        )
        return delta
    table = list(seq.fork_table)
    seq.fork_table = None  # handed over: later grants are changes to the executor's copy
    if delta is not None:
        delta.apply(table)
    return TableDelta(0, tuple(table))
