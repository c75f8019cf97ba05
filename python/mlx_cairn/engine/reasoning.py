"""A reasoning budget: after ``budget`` reasoning tokens the engine closes the block itself.

Anthropic's ``thinking.budget_tokens`` (and the effort levels mapped onto it)
bound how long a model may reason. The tracker follows one sequence's sampled
ids: reasoning starts at the first output token when the prompt left a
``<think>`` block open, or when the model writes the open tag; it ends when
the model writes the close tag. Once ``budget`` tokens were spent inside the
block, :meth:`ReasoningBudget.push` answers the token ids of the close tag,
which the engine appends in place of the next sampled token, so the answer
follows::

    rb = ReasoningBudget(budget=2, open_ids=[5], close_ids=[6], in_reasoning=True)
    rb.push(10), rb.push(11)       # (None, [6]): the budget is spent, force </think>
"""

from __future__ import annotations


class ReasoningBudget:
    """Counts one sequence's reasoning tokens (tags matched on token ids)."""

    __slots__ = ("_close", "_open", "_tail", "budget", "closed", "in_reasoning", "spent")

    def __init__(
        self, *, budget: int, open_ids: list[int], close_ids: list[int], in_reasoning: bool
    ) -> None:
        if budget < 0 or not close_ids:
            raise ValueError("a reasoning budget needs budget >= 0 and the close tag's ids")
        self.budget = budget
        self._open = list(open_ids)
        self._close = list(close_ids)
        self._tail: list[int] = []
        self.in_reasoning = in_reasoning
        #: The block was closed (by the model or by the budget): nothing more to do.
        self.closed = False
        self.spent = 0

    def push(self, token: int) -> list[int] | None:
        """Feed one sampled id; return the ids to force now, or None."""
        if self.closed:
            return None
        keep = max(len(self._open), len(self._close))
        self._tail = [*self._tail[-(keep - 1) :], token] if keep > 1 else [token]
        if not self.in_reasoning:
            if self._open and self._tail[-len(self._open) :] == self._open:
                self.in_reasoning = True
            return None
        if self._tail[-len(self._close) :] == self._close:
            self.closed = True
            return None
        self.spent += 1
        if self.spent >= self.budget:
            self.closed = True
            return list(self._close)
        return None
