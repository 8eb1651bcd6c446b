"""Load a trained :class:`TagNet` and use it as the search's prior / value model."""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from ..errors import TagError
from .features import ADDED_COLUMNS, COARSE_ABOVE, JointContext, coarse_level
from .model import NetConfig, TagNet, value_to_reward
from .transforms import JointNormalize

DEFAULT_CHECKPOINT = Path(__file__).resolve().parent / "predictor.pt"
"""The shipped predictor (``tag train`` reproduces it)."""


@contextmanager
def one_thread() -> Iterator[None]:
    """Run the block on one torch thread, restoring the thread count after: the predictor's graphs
    are small (intra-op threads cost more in synchronisation, and in contention with the
    simulator, than they save), and fitting on one thread makes ``tag train`` reproducible
    (:func:`tag.training.train.fit`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


class CheckpointError(TagError):
    """A predictor checkpoint is missing or malformed."""


def save_checkpoint(path: str | os.PathLike, net: TagNet, meta: dict | None = None) -> None:
    """Write a predictor checkpoint (weights and config only, loadable with ``weights_only``)."""
    from ..io import save_tensors
    save_tensors(path, {"format": "tag-predictor", "version": 1, "config": net.cfg.to_dict(),
                        "state_dict": {k: v.detach().clone() for k, v in net.state_dict().items()},
                        "meta": dict(meta or {})})


def load_net(path: str | os.PathLike | None = None) -> tuple[TagNet, dict]:
    """Load a predictor checkpoint (default: the shipped one)."""
    p = Path(path) if path is not None else DEFAULT_CHECKPOINT
    from ..io import load_tensors
    if not p.exists():
        raise CheckpointError(f"{p}: predictor checkpoint not found (train one with `tag train`, or plan with --prior uniform)")
    ck = load_tensors(p, CheckpointError, "predictor checkpoint")
    if not isinstance(ck, dict) or ck.get("format") != "tag-predictor":
        raise CheckpointError(f"{p}: format: expected 'tag-predictor' checkpoint")
    try:
        net = TagNet(NetConfig(**ck["config"]))
        net.load_state_dict(_widened(ck["state_dict"], net))
    except (TypeError, ValueError, RuntimeError, KeyError) as e:
        raise CheckpointError(f"{p}: config/state_dict: {str(e).splitlines()[0]}") from None
    net.eval()
    return net, ck.get("meta", {})


def checkpoint_coarse_above(meta: dict, path=None) -> int:
    """The device count above which a checkpoint's network was trained on the machine graph
    (``meta["coarse_above"]``; :data:`tag.gnn.features.COARSE_ABOVE` where absent)."""
    v = meta.get("coarse_above", COARSE_ABOVE)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise CheckpointError(f"{path or DEFAULT_CHECKPOINT}: meta.coarse_above: expected a positive integer, got {v!r}")
    return v


def _widened(state: dict, net: TagNet) -> dict:
    """``state`` with the input weights of the feature columns added since it was trained
    (:data:`tag.gnn.features.ADDED_COLUMNS`, appended last) set to zero: the network computes
    exactly what it did on the columns it knows; and, for a checkpoint from before the plan head
    (2026-11-27), the plan head's untrained initial weights (:class:`Predictor` then leaves the
    plan-level decisions to the search's fixed prior: ``meta["plan_head"]`` is absent). Any other
    shape mismatch is left to ``load_state_dict`` to report."""
    state = dict(state)
    own = net.state_dict()
    if not any(k.startswith("plan.") for k in state):
        state.update({k: v for k, v in own.items() if k.startswith("plan.")})
    for nt, extra in ADDED_COLUMNS.items():
        key = f"node_in.{nt}.weight"
        w = state.get(key)
        if w is not None and w.dim() == 2 and own[key].shape == (w.shape[0], w.shape[1] + extra):
            state[key] = torch.cat([w, w.new_zeros(w.shape[0], extra)], 1)
    return state


class Predictor:
    """Batched prior / value calls of a :class:`TagNet` for the searchers.

    ``predictor.bind(space, t_ref)`` gives a ``prior_fn(space, states)`` for
    :func:`tag.search.mcts.run_playouts`.
    """

    def __init__(self, net: TagNet, coarse_above: int = COARSE_ABOVE, plan_head: bool = False):
        self.net = net.eval()
        self.plan_head = plan_head
        """Whether the network's plan head was trained (:meth:`bind_plan` gives the search its
        prior over plan-level decisions; False: the search's fixed prior)."""
        self.coarse_above = coarse_above
        """Clusters of more devices than this are encoded with one device node per machine
        (:mod:`tag.gnn.features`, ``coarse="machine"``)."""
        self.norm = JointNormalize()
        self._ctx: dict[int, JointContext] = {}

    @classmethod
    def load(cls, path: str | os.PathLike | None = None) -> Predictor:
        """The checkpoint's network, encoding clusters as it was trained (``meta["coarse_above"]``;
        :data:`tag.gnn.features.COARSE_ABOVE` where the checkpoint does not say)."""
        net, meta = load_net(path)
        return cls(net, checkpoint_coarse_above(meta, path), plan_head=bool(meta.get("plan_head")))

    def context(self, space, t_ref: float) -> JointContext:
        key = id(space)
        ctx = self._ctx.get(key)
        if ctx is None or ctx.space is not space or ctx.t_ref != t_ref:
            ctx = JointContext(space, t_ref, coarse=coarse_level(space.num_devices, self.coarse_above))
            self._ctx = {key: ctx}
        return ctx

    @torch.no_grad()
    def predict(self, ctx: JointContext, states: Sequence) -> tuple[np.ndarray, np.ndarray]:
        """``(priors [n, A], predicted rewards [n])``.

        Runs single-threaded: these graphs are small, and intra-op threads cost more in
        synchronisation (and in contention with the simulator) than they save."""
        with one_thread():
            data = self.norm(ctx.encode(states))
            logits, value = self.net(data)
        logits = logits.view(len(states), ctx.a)
        pri = torch.softmax(logits.double(), dim=1).numpy()
        return pri, value_to_reward(value).double().numpy()

    def one_shot(self, space, t_ref: float, feedback=None, max_groups: int | None = None) -> tuple[int, ...]:
        """The network's own plan, in one batched call: every op-group takes its most likely
        action (its equivalent actions' prior mass pooled) as if it were the group decided at
        the search's root, where nothing is decided yet.

        Args:
            space: the :class:`tag.search.ActionSpace`.
            t_ref: the better data-parallel iteration time (s).
            feedback: the simulator's :class:`tag.search.evaluate.Feedback` on the root's own
                plan (neutral when omitted).
            max_groups: ask only for the first ``max_groups`` groups in decision order (the
                largest stakes) and complete the rest by the search's completion rule: the call
                encodes one state per group asked, each with every group, so its cost grows with
                the square of the group count.

        Not a plan the tree search reaches: MCTS completes undecided groups by a rule
        (:meth:`tag.search.space.ActionSpace.resolve`), and with 50 playouts it refines only its
        first few decisions. :func:`tag.planner.find_plan` simulates this plan as one playout of the
        budget (what it gains: "The network's one-shot plan" in ``training/README.md`` at 589f1db)."""
        from ..search.evaluate import Feedback
        from ..search.mcts import SearchState
        k = space.num_groups
        none = np.full(k, -1, dtype=np.int64)
        fb = feedback if feedback is not None else Feedback.neutral(space.num_devices, k)
        chosen = space.order[:max_groups] if max_groups is not None else space.order
        pri, _ = self.predict(self.context(space, t_ref), [SearchState(none, g, fb) for g in chosen])
        assign = none.copy()
        for g, p in zip(chosen, pri):
            assign[g] = int(np.argmax(space.canonical_prior(g, p)))
        return space.resolve(assign)  # groups beyond max_groups: the search's completion rule

    @torch.no_grad()
    def plan_z(self, ctx: JointContext, feedback) -> torch.Tensor:
        """[1, 2H] ``z`` of the space's empty plan with ``feedback`` (the root plan's: as the plan
        head is trained, :mod:`tag.training.plan_head`)."""
        from ..search.mcts import SearchState
        none = np.full(ctx.space.num_groups, -1, np.int64)
        with one_thread():
            return self.net.embed(self.norm(ctx.encode([SearchState(none, ctx.space.order[0], feedback)])))

    @torch.no_grad()
    def plan_scores(self, z: torch.Tensor, options: np.ndarray) -> np.ndarray:
        """[O] softmax of the plan head over ``options`` [O, PLAN_FEATURES] (:mod:`tag.gnn.plan_head`)
        given ``z`` [1, 2H] (:meth:`plan_z`)."""
        logits = self.net.plan_logits(z, torch.as_tensor(options, dtype=z.dtype)[None])[0]
        return torch.softmax(logits.double(), 0).numpy()

    def bind_plan(self, space, t_ref: float, simulator) -> PlanHeadPrior | None:
        """The plan head's :class:`PlanHeadPrior` for ``space`` (the ``plan_fn`` of
        :func:`tag.search.mcts.mcts_search`), or None where the plan head is untrained, the space
        has no pipelines or ``simulator`` has no tables for the features' bounds (not a
        :class:`tag.sim.Simulator`)."""
        if not self.plan_head or not space.plan_options or not hasattr(simulator, "static"):
            return None
        return PlanHeadPrior(self, space, t_ref, simulator)

    def bind(self, space, t_ref: float):
        ctx = self.context(space, t_ref)

        def prior_fn(sp, states):
            return self.predict(ctx, states)
        return prior_fn


class PlanHeadPrior:
    """The plan head bound to one search: ``prior(space, state) -> [A]``, the prior over the options
    of ``state``'s plan-level decision (option ``i`` at action ``i``), and :meth:`complete`.

    ``z`` comes from the first state asked (the root's feedback; neutral before), as in training
    (:mod:`tag.training.plan_head`).

    Args:
        predictor: a :class:`Predictor` with a trained plan head.
        space: the search's :class:`tag.search.space.ActionSpace` (with pipelines).
        t_ref: the data-parallel reference time, seconds.
        simulator: the search's :class:`tag.sim.Simulator` (its tables bound the options).
    """

    def __init__(self, predictor: Predictor, space, t_ref: float, simulator):
        from ..sim import lower_bound
        from .plan_head import simulator_bound
        self.predictor, self.space, self.t_ref = predictor, space, t_ref
        self.ctx = predictor.context(space, t_ref)
        self.bound = simulator_bound(space, simulator)
        self.lower_bound_s = float(lower_bound(space.graph, space.topology, space.cost_model))
        self._z: torch.Tensor | None = None
        self._completed: dict = {}
        self.fallback: str | None = None
        """None while the head scores; else why it stopped (one line, for the plan's ``meta``): a
        case its features cannot handle. From then on the rule it replaces decides: the fixed
        plan-level prior (:func:`tag.search.mcts.plan_prior`) and the default completion
        (:meth:`tag.search.space.ActionSpace.default_pipeline_key`)."""

    def scores(self, sp, chosen: dict | None, decision: int, feedback) -> np.ndarray:
        """[O] the head's softmax over the options of plan-level decision ``decision`` given the
        choices ``chosen`` so far."""
        from ..search.evaluate import Feedback
        from .plan_head import plan_option_features
        if self._z is None:  # the first state asked is the root (or, before it, the neutral feedback)
            self._z = self.predictor.plan_z(self.ctx, feedback or Feedback.neutral(sp.num_devices, sp.num_groups))
        x = plan_option_features(sp, chosen, decision, self.bound, self.t_ref, self.lower_bound_s)
        return self.predictor.plan_scores(self._z, x)

    def _guarded(self, run):
        """``run()``, or None once the head has met a case it cannot handle (:attr:`fallback`)."""
        if self.fallback is not None:
            return None
        try:
            return run()
        except MemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 - any case the head's features cannot handle: the fixed rule
            what = " ".join(str(exc).split())[:200]
            self.fallback = (f"plan head failed ({type(exc).__name__}: {what}); the fixed plan-level prior and "
                             "default completion used instead")
            return None

    def __call__(self, sp, state) -> np.ndarray:
        """[A] the head's prior (all zeros after a :attr:`fallback`: the search's fixed prior)."""
        out = np.zeros(sp.num_actions)
        p = self._guarded(lambda: self.scores(sp, state.pipeline, state.plan_decision, state.feedback))
        if p is not None:
            out[: len(p)] = p
        return out

    def complete(self, chosen: dict) -> dict:
        """``chosen`` with every undecided plan-level choice made, in decision order, as the head's
        most likely option whose pipeline (completed by the fixed defaults, as the head's option
        features describe it) the simulator's static bound does not put out of memory, else the
        most likely one (for :attr:`tag.search.space.ActionSpace.pipeline_completion`; memoised).
        The bound's out-of-memory is sound (its peak memory is at most the simulator's), so a
        pipeline that fits is never passed over: on llama-7b (bf16, batch 64) over
        ``hetero-64gpu`` the head's most likely schedule, GPipe, runs every pipeline out of
        memory; 1F1B fits (2026-11-27)."""
        from ..search.space import PLAN_DECISIONS
        key = tuple(sorted(chosen.items()))
        if key not in self._completed:
            def run() -> dict:
                c, sp = dict(chosen), self.space
                for d, name in enumerate(PLAN_DECISIONS):
                    if name not in c:
                        opts = sp.options_at(name, c)
                        order = np.argsort(-self.scores(sp, c, d, None), kind="stable")
                        fits = (i for i in order if not self.bound(sp.default_pipeline_key({**c, name: opts[i]}))[1])
                        c[name] = opts[int(next(fits, order[0]))]
                return c
            c = self._guarded(run)
            if c is None:  # (after a fallback: left to the default completion)
                return dict(chosen)
            self._completed[key] = c
        return dict(self._completed[key])
