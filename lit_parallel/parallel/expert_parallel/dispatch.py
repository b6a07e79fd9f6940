"""Token dispatch and combine: every routed (token, expert) pair travels to the rank holding its expert by
one all-to-all, the local experts run, and the results travel back by a second one.

:func:`dispatch_combine` is the whole exchange for one MoE layer call, differentiable (backward runs the
same two all-to-alls in reverse, with the same split sizes). No pair is dropped unless a capacity factor is
given; then each expert takes at most ``ceil(capacity_factor * pairs / num_experts)`` of a rank's pairs, in
token order, and the rest contribute zero (counted in :class:`ExchangeStats`).

Host syncs: one per call (the split sizes; two with a capacity factor, whose kept counts are exchanged
again): an all-to-all of uneven sizes takes them as host integers. The rows themselves stay on the device.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

__all__ = ["ExchangeStats", "dispatch_combine"]


@dataclass
class ExchangeStats:
    """What one rank's MoE layers exchanged since the last :meth:`reset` (read by tests, bench and logs).

    Attributes:
        calls: dispatch/combine exchanges (one per MoE layer forward).
        rows_sent: (token, expert) pairs this rank sent in dispatch (its own pairs, those staying local
            included: they are part of the all-to-all's input).
        rows_received: pairs this rank's experts received (and sent back in combine).
        rows_sent_remote / rows_received_remote: the same, leaving / arriving from other ranks only.
        dropped: pairs dropped by the capacity factor (0 without one).
        per_expert: pairs each global expert received from this rank, summed over calls.
    """

    calls: int = 0
    rows_sent: int = 0
    rows_received: int = 0
    rows_sent_remote: int = 0
    rows_received_remote: int = 0
    dropped: int = 0
    per_expert: list[int] = field(default_factory=list)

    def reset(self) -> None:
        self.calls = self.rows_sent = self.rows_received = 0
        self.rows_sent_remote = self.rows_received_remote = self.dropped = 0
        self.per_expert = []

    def add(self, other: ExchangeStats) -> None:
        """Count ``other``'s exchanges too."""
        for name in (
            "calls",
            "rows_sent",
            "rows_received",
            "rows_sent_remote",
            "rows_received_remote",
            "dropped",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        self._add_per_expert(other.per_expert)

    def _add_per_expert(self, per_expert: list[int]) -> None:
        self.per_expert += [0] * (len(per_expert) - len(self.per_expert))
        for i, n in enumerate(per_expert):
            self.per_expert[i] += n

    def record(
        self, send: list[int], receive: list[int], me: int, per_expert: list[int], dropped: int
    ) -> None:
        """One exchange: rows per destination and per source rank (``me`` is this rank), pairs per expert."""
        self.calls += 1
        self.rows_sent += sum(send)
        self.rows_received += sum(receive)
        self.rows_sent_remote += sum(send) - send[me]
        self.rows_received_remote += sum(receive) - receive[me]
        self.dropped += dropped
        self._add_per_expert(per_expert)


def _all_to_all(
    x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: dist.ProcessGroup
) -> torch.Tensor:
    """Differentiable uneven all-to-all of rows: backward sends the gradients back the same way."""
    from lit_parallel._compat import all_to_all_single_autograd

    return all_to_all_single_autograd(x.contiguous(), out_splits, in_splits, group)


def _capacity_keep(sorted_expert: torch.Tensor, counts: list[int], capacity: int) -> torch.Tensor:
    """Mask over pairs sorted by expert: the first ``capacity`` pairs of each expert (token order)."""
    starts = torch.tensor([0, *counts[:-1]], device=sorted_expert.device).cumsum(0)
    position = torch.arange(sorted_expert.numel(), device=sorted_expert.device) - starts[sorted_expert]
    return position < capacity


def dispatch_combine(
    rows: torch.Tensor,
    expert: torch.Tensor,
    num_experts: int,
    group: dist.ProcessGroup,
    run_local: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    *,
    pairs_per_row: int = 1,
    capacity_factor: float | None = None,
    stats: ExchangeStats | None = None,
) -> torch.Tensor:
    """Send each row to the rank holding ``expert[i]``, run ``run_local`` there, and bring the results back.

    Args:
        rows: ``[N / pairs_per_row, H]``: pair ``i`` sends row ``i // pairs_per_row`` (a token routed to its
            top-k experts is one row with ``pairs_per_row = k``, never copied k times on the sender).
        expert: ``[N]`` global expert index of each pair (``[T, k]`` is flattened); ``num_experts`` marks a row no expert takes (it
            returns zeros, as transformers' masking index does).
        num_experts: experts in the layer, split evenly over the group's ranks in order (rank ``r`` holds
            ``r * E/ep ... (r+1) * E/ep - 1``).
        run_local: ``(received_rows [M, H], local_expert [M]) -> [M, H_out]``, the local experts.
        capacity_factor: ``None``: every row is taken (exact). Otherwise each expert takes at most
            ``ceil(capacity_factor * N / num_experts)`` of this rank's rows, the first in row order; the rest
            return zeros and are counted in ``stats.dropped``.

    Returns ``[N, H_out]``: row ``i`` is expert ``expert[i]``'s output for pair ``i``.
    """
    ep = dist.get_world_size(group)
    per_rank = num_experts // ep
    expert = expert.reshape(-1)
    order = torch.argsort(expert, stable=True)
    counts = torch.bincount(expert, minlength=num_experts + 1)[:num_experts]
    # one host read: this rank's counts per expert (split sizes, capacity) after the count exchange
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    host = torch.cat([counts, recv_counts]).tolist()
    sent, received = host[:num_experts], host[num_experts:]
    n_routed = sum(sent)
    routed = order[:n_routed]
    dropped = 0
    if capacity_factor is not None:
        capacity = math.ceil(capacity_factor * expert.numel() / num_experts)
        kept = [min(c, capacity) for c in sent]
        if kept != sent:
            routed = routed[_capacity_keep(expert[routed], sent, capacity)]
        dropped = n_routed - sum(kept)
        sent = kept
        # the receivers' counts shrink alike: exchange the kept counts (a second small all-to-all)
        kept_t = torch.tensor(kept, dtype=counts.dtype, device=counts.device)
        dist.all_to_all_single(recv_counts, kept_t, group=group)
        received = recv_counts.tolist()
    send_splits = [sum(sent[r * per_rank : (r + 1) * per_rank]) for r in range(ep)]
    recv_splits = [sum(received[r * per_rank : (r + 1) * per_rank]) for r in range(ep)]
    x = rows[routed // pairs_per_row]
    got = _all_to_all(x, recv_splits, send_splits, group)
    # received rows: by source rank, then by local expert; the local expert of each
    local = torch.arange(per_rank, device=rows.device).repeat(ep)
    local_expert = torch.repeat_interleave(local, torch.tensor(received, device=rows.device))
    y = run_local(got, local_expert)
    back = _all_to_all(y, send_splits, recv_splits, group)
    out = back.new_zeros((expert.numel(), *back.shape[1:]))
    out = out.index_copy(0, routed, back)
    if stats is not None:
        stats.record(send_splits, recv_splits, dist.get_rank(group), sent, dropped)
    return out
