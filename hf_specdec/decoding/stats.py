"""What one speculative `generate` call did: the figures benchmarks and the Sequoia planner read."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SpeculationStats:
    """Counters and timers of one call. Times are wall-clock seconds."""

    method: str = ""
    verifier: str = ""
    plan_source: str = ""  # where the tree shape or budget came from, when the method looks one up
    call_price: str = ""  # the price a single sequence's call was given before drafting (`PlainGuard.price`)
    target_forwards: int = 0  # the steps' target passes (a plain first step runs none: the prompt pass gave its token)
    draft_forwards: int = 0
    drafted_tokens: int = 0
    new_tokens: int = 0
    tokens_per_step: list[int] = field(default_factory=list)
    plain_steps: int = 0  # steps that verified the root alone (a plain target step: the guard or the sizing chose it)
    shrunk_steps: int = 0  # steps whose tree the sizing cut below the method's full tree (plain steps not counted)
    size_probes: int = 0  # steps the sizing drafted a tree larger than any target pass it had timed in the call
    deepened_levels: int = 0  # levels drafted below the shape the sizing chose (`sequoia` on a CPU, a sure draft)
    accepted_ranks: Counter = field(default_factory=Counter)  # (depth, rank) -> count
    reached_depths: Counter = field(default_factory=Counter)  # depth -> steps that verified a node there
    time_plan: float = 0.0  # looking the plan up before decoding (a first call on new hardware measures its curves)
    time_prefill: float = 0.0
    time_drafting: float = 0.0
    time_verifying: float = 0.0
    time_total: float = 0.0
    time_target_forward: float = 0.0  # inside the target's tree passes (part of time_verifying)
    time_draft_forward: float = 0.0  # inside the draft model's passes (part of time_drafting)
    tree_pass_sizes: set[int] = field(default_factory=set)  # padded node counts on a static cache (one graph each)
    draft_pass_sizes: set[int] = field(default_factory=set)  # the draft's padded pass sizes on its static cache
    compiled: bool = False  # whether tree passes ran a compiled forward (compile_config / generation config)
    sizes_kept_eager: set[int] = field(default_factory=set)  # tree sizes whose compiled pass measured no faster
    draft_sizes_kept_eager: set[int] = field(default_factory=set)  # the same for the draft's passes
    graphs_compiled: int = 0  # graphs torch.compile made during the call (dynamo's unique_graphs)
    #: steps ran captured whole (`captured=True`, decoding/captured.py): each step is timed whole, in time_verifying;
    #: its passes are not timed apart (time_target_forward, time_draft_forward stay 0, time_engine is None)
    captured: bool = False

    @property
    def mean_tokens_per_step(self) -> float:
        return sum(self.tokens_per_step) / max(len(self.tokens_per_step), 1)

    @property
    def tokens_per_step_histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.tokens_per_step).items()))

    @property
    def time_overhead(self) -> float:
        """Seconds of the loop outside drafting and verifying (streaming, stopping criteria, bookkeeping)."""
        return max(self.time_total - self.time_prefill - self.time_drafting - self.time_verifying, 0.0)

    @property
    def time_engine(self) -> float | None:
        """Seconds of Python/tensor bookkeeping outside any model pass: what the engine itself costs (None for
        captured steps, whose passes run inside one function, untimed apart)."""
        if self.captured:
            return None
        return max(self.time_total - self.time_prefill - self.time_target_forward - self.time_draft_forward, 0.0)

    def acceptance_by_rank(self) -> list[float]:
        """Fraction of steps in which the k-th drafted child was the accepted one, over all depths."""
        visits = sum(self.reached_depths.values())
        if not visits:
            return []
        ranks = Counter()
        for (_, rank), count in self.accepted_ranks.items():
            ranks[rank] += count
        return [ranks[r] / visits for r in range(max(ranks, default=-1) + 1)]

    def as_dict(self) -> dict:
        return {
            "method": self.method,
            "verifier": self.verifier,
            "plan_source": self.plan_source,
            "call_price": self.call_price,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "drafted_tokens": self.drafted_tokens,
            "new_tokens": self.new_tokens,
            "mean_tokens_per_step": self.mean_tokens_per_step,
            "tokens_per_step_histogram": self.tokens_per_step_histogram,
            "plain_steps": self.plain_steps,
            "shrunk_steps": self.shrunk_steps,
            "size_probes": self.size_probes,
            "deepened_levels": self.deepened_levels,
            "acceptance_by_rank": self.acceptance_by_rank(),
            "time_plan": self.time_plan,
            "time_prefill": self.time_prefill,
            "time_drafting": self.time_drafting,
            "time_verifying": self.time_verifying,
            "time_overhead": self.time_overhead,
            "time_total": self.time_total,
            "time_target_forward": self.time_target_forward,
            "time_draft_forward": self.time_draft_forward,
            "time_engine": self.time_engine,
            "tree_pass_sizes": sorted(self.tree_pass_sizes),
            "draft_pass_sizes": sorted(self.draft_pass_sizes),
            "compiled": self.compiled,
            "sizes_kept_eager": sorted(self.sizes_kept_eager),
            "draft_sizes_kept_eager": sorted(self.draft_sizes_kept_eager),
            "graphs_compiled": self.graphs_compiled,
            "captured": self.captured,
        }
