"""The two batched sides of a round, over many rows addressed by request id.

Every batched driver holds its live sequences as ROWS of one batched engine, so the
rounds of many sequences share forwards: the offline batched engine
(:mod:`speclab.decoding.batch_loop`, one :func:`~speclab.decoding.loop.rounds` generator
per row in lockstep) and the Serve replicas (``serve_apps``: requests arrive and leave
at any time). Each round only some rows may be ready, so both pools take a subset of
their rows per call; the other rows feed nothing and keep their state.

* :class:`TargetPool`: the target over one batched cache
  (:class:`~speclab.decoding.batch_runner.BatchRunner`), each row with its own sampling
  settings, verification rule and rng: prefill of joining rows in ONE forward, and ONE
  forward per round that verifies every ready row's tree (padded, with a per-row tree
  mask and position ids), each row judged by its own rule and pruned to its own path.
* :class:`DraftPool`: a :class:`~speclab.decoding.drafting.BatchDrafter` per distinct
  sampling setting (a drafter samples with its request's settings), built by the
  method's registry entry (batched chain / tree / SALF drafting, else one drafter per
  row).

A sampled row has ONE random generator (:class:`NewRow` ``generator``), shared by its
drafter and its rule: offline the two pools hold the same object; between Serve
deployments its state travels with the round (:func:`generator_state`). At temperature 0
every row's tokens equal that sequence decoded alone.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import torch

from speclab.decoding.batch_runner import BatchRunner
from speclab.decoding.drafting import BatchDrafter
from speclab.decoding.features import FeatureSpec, layer_ids, num_decoder_layers
from speclab.decoding.host import fetch_lists, fetch_nested
from speclab.decoding.logprobs import logprob_entries, logprob_inputs, prompt_logprobs
from speclab.decoding.lookahead import Ahead, RowAhead
from speclab.decoding.rules import RuleSpec, judge_rule, prepare_rule
from speclab.decoding.sampling import SamplingParams
from speclab.decoding.sides import Proposal, VerifyResult, check_prompt, committed_tokens
from speclab.decoding.tree import TokenTree


@dataclass
class NewRow:
    """A sequence joining a pool: its id, prompt, sampling settings, rule and rng; for the
    draft pool also what the target's prefill returned (top tokens per prompt position,
    ``[P-1, H]`` features) when the method reads them."""

    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    rule: RuleSpec | None = None
    generator: torch.Generator | None = None
    prefill_top: list[list[int]] | None = None
    features: torch.Tensor | None = None
    logprobs: int | None = None  # target log-probs of its tokens, with this many alternatives
    echo: bool = False  # and of its prompt's tokens (with ``logprobs``)


@dataclass
class Prefilled:
    """What the target's prefill returns for one joining row: its ``prefill_top_k`` best
    tokens per prompt position (or None), its ``[P-1, H]`` features (or None) and, for a
    row that asked for ``logprobs`` with ``echo``, its prompt tokens' entries
    (:func:`~speclab.decoding.logprobs.prompt_logprobs`, or None)."""

    top: list[list[int]] | None
    features: torch.Tensor | None
    prompt_logprobs: list | None = None


@dataclass
class _Prefilling:
    """A row whose prompt enters the cache chunk by chunk: ``done`` of its prefill tokens
    (``prompt_ids[:-1]``) are in, with what their forwards gave so far."""

    row: NewRow
    spec: tuple[int, ...]
    top_k: int
    done: int = 0
    top: list | None = None
    features: list | None = None
    logits: list | None = None  # echo: the prompt positions' logits, for its log-probs

    @property
    def total(self) -> int:
        return len(self.row.prompt_ids) - 1

    @property
    def echo(self) -> bool:
        """Its prompt tokens' log-probs are asked for."""
        return self.row.logprobs is not None and self.row.echo

    @property
    def needs_logits(self) -> bool:
        """A prefill forward must return its logits (top tokens or echoed log-probs)."""
        return bool(self.top_k) or self.echo

    def absorb(self, logits: torch.Tensor | None, features: torch.Tensor | None,
               n: int) -> None:
        """Take one chunk's ``n`` positions: ``logits`` ``[n, V]`` (None when nothing
        reads them), ``features`` ``[n, F]`` (None without features)."""
        if self.top_k and n:
            self.top = (self.top or []) + fetch_lists(
                logits[:n].topk(min(self.top_k, logits.shape[-1]), -1).indices)[0]
        if features is not None:
            self.features = (self.features or []) + [features[:n].clone()]
        if self.echo and n:
            self.logits = (self.logits or []) + [logits[:n]]
        self.done += n

    def result(self) -> Prefilled:
        """What the whole prefill gives the row (:class:`Prefilled`)."""
        r = self.row
        feats = None if self.features is None else torch.cat(self.features)
        echo = None
        if self.echo:
            echo = prompt_logprobs(torch.cat(self.logits) if self.logits else None,
                                   r.prompt_ids, r.logprobs)
        return Prefilled(self.top if self.top_k and self.total else None, feats, echo)


def seeded(seed: int) -> torch.Generator:
    """A row's random generator from its request's seed (the same everywhere)."""
    return torch.Generator().manual_seed(int(seed))


def generator_state(generator: torch.Generator | None) -> bytes | None:
    """A generator's state as bytes (what travels between deployments with a round)."""
    return None if generator is None else generator.get_state().numpy().tobytes()


def set_generator_state(generator: torch.Generator, state: bytes | None) -> None:
    """Continue ``generator`` from :func:`generator_state`'s bytes (None: unchanged)."""
    if state is not None:
        generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))


def _index(rids: list[str], rid: str) -> int:
    try:
        return rids.index(rid)
    except ValueError:
        raise KeyError(rid) from None


class TargetPool:
    """The target side of every live row: one batched cache, a row per sequence."""

    def __init__(self, runner: BatchRunner, features: bool = False,
                 feature_spec: FeatureSpec = None) -> None:
        """``features``: return the target's features with prefills and verdicts (the
        method's drafter reads them), by default those ``feature_spec`` names
        (:mod:`speclab.decoding.features`; None: the last layer's)."""
        self.runner = runner
        self.features = False
        self.spec = self._resolve(feature_spec)  # the rows' default
        self.staging: BatchRunner | None = None  # rows prefilled apart (chunked prefill)
        self.tracked: list[tuple[int, ...]] = []  # the feature layers both runners keep
        if features:
            self.track_features(feature_spec)
        self.rids: list[str] = []
        self.roots: list[int] = []
        self.samplings: list[SamplingParams] = []
        self.rules: list[RuleSpec] = []
        self.generators: list[torch.Generator] = []
        self.logprobs: list[int | None] = []
        self.specs: list[tuple[int, ...]] = []  # each row's features (when returned)
        #: rows whose prompt is still entering a cache of its own (the staging runner's
        #: rows, in this order; :meth:`start` with ``chunk``)
        self.prefilling: dict[str, _Prefilling] = {}
        #: rows whose prompt waits for the next :meth:`verify` forward (:meth:`start` with
        #: ``ride``), and what the prefill gave the rows that joined since
        #: :meth:`take_ridden` was last called
        self.riding: list[_Prefilling] = []
        self.ridden: dict[str, Prefilled] = {}

    def __contains__(self, rid: str) -> bool:
        return rid in self.rids

    def __len__(self) -> int:
        return len(self.rids)

    def _resolve(self, spec: FeatureSpec) -> tuple[int, ...]:
        return layer_ids(spec, num_decoder_layers(self.runner.model.config))

    def track_features(self, spec: FeatureSpec = None) -> None:
        """From now on return features, keeping those ``spec`` names too (a feature
        drafter's rows arrived)."""
        self.features = True
        self.tracked.append(self._resolve(spec))
        for runner in (self.runner, self.staging):
            if runner is not None:
                runner.track_hidden(self.tracked[-1])

    def start(self, rows: list[NewRow], prefill_top_k: int = 0,
              feature_spec: FeatureSpec | bool = True,
              chunk: int | None = None, ride: bool = False) -> list[Prefilled | None]:
        """Prefill ``prompt_ids[:-1]`` of every new row in ONE forward (a row id that is
        already here starts over). Returns per row what the prefill gives it
        (:class:`Prefilled`). ``feature_spec``: the features these rows get (True: the
        pool's; tracked with :meth:`track_features` first). ``chunk``: a row with more
        prompt tokens than that is prefilled apart, ``chunk`` tokens now and the rest by
        :meth:`prefill_step` (None in its place until then; it joins the verified rows
        once its prompt is in), so a long prompt never makes one forward long.
        ``ride``: the rows (but those prefilled apart) wait for the next :meth:`verify`,
        which prefills them in its own forward where their prompt is no longer than
        that forward's widest tree (a row more, no padding more) and the others in one
        forward just before it, or for :meth:`settle`; None in their place, and what
        their prefill gives them comes from :meth:`take_ridden` after that call. A
        short prompt then costs no forward of its own: at 16 rows of the reference pair
        a step whose joins had their own prefill forward took 12.6 ms of target time
        against 6.9 ms without."""
        spec = self.spec if feature_spec is True else self._resolve(feature_spec)
        if len({r.rid for r in rows}) != len(rows):
            raise ValueError("rows: a request id appears twice")
        if chunk is not None and chunk < 1:
            raise ValueError(f"chunk: must be >= 1, got {chunk}")
        for r in rows:
            check_prompt(r.prompt_ids, self.runner.vocab_size)
        for r in rows:
            self.end(r.rid)
        states = [_Prefilling(r, spec, prefill_top_k) for r in rows]
        long = [st for st in states if chunk is not None and st.total > chunk]
        whole = [st for st in states if st not in long]
        if ride:
            self.riding += whole
        else:
            self._prefill(self.runner, whole, None)
            for st in whole:
                self._join(st)
        if long:
            if self.staging is None:
                self.staging = BatchRunner(self.runner.model)
                for layers in self.tracked:
                    self.staging.track_hidden(layers)
            self._prefill(self.staging, long, chunk)
            for st in long:
                self.prefilling[st.row.rid] = st
        return [None if ride or st in long else st.result() for st in states]

    def settle(self, states: list[_Prefilling] | None = None) -> None:
        """Prefill the riding rows ``states`` (default: all of them) in ONE forward of
        their own; they join the verified rows (their results: :meth:`take_ridden`)."""
        states = list(self.riding) if states is None else states
        if not states:
            return
        self.riding = [st for st in self.riding if all(st is not x for x in states)]
        self._prefill(self.runner, states, None)
        for st in states:
            self._join(st)
            self.ridden[st.row.rid] = st.result()

    def take_ridden(self) -> dict[str, Prefilled]:
        """``{row id: Prefilled}`` of the riding rows that joined since the last call."""
        out, self.ridden = self.ridden, {}
        return out

    def _board(self, width: int) -> list[_Prefilling]:
        """The riding rows whose prompt fits a forward ``width`` tokens wide, given empty
        rows after the verified ones; the others are prefilled now (:meth:`settle`)."""
        riders = [st for st in self.riding if st.total <= width]
        self.settle([st for st in self.riding if st.total > width])
        self.riding = []
        self.runner.add_empty_rows(len(riders))
        return riders

    def _prefill(self, runner: BatchRunner, states: list[_Prefilling],
                 chunk: int | None) -> None:
        """New rows for ``states`` in ``runner``, each with its first ``chunk`` prompt
        tokens (None: all), in ONE forward."""
        if not states:
            return
        first = [min(st.total, chunk or st.total) for st in states]
        needed = any(st.needs_logits for st in states)
        logits = runner.add_rows([list(st.row.prompt_ids[:n])
                                  for st, n in zip(states, first, strict=True)], needed)
        for j, (st, n) in enumerate(zip(states, first, strict=True)):
            feats = runner.features(st.spec)[j] if self.features else None
            st.absorb(logits[j] if needed else None, feats, n)

    def _join(self, st: _Prefilling) -> None:
        """The row of ``st`` (its prompt all in the main runner) becomes a verified row."""
        r = st.row
        self.rids.append(r.rid)
        self.roots.append(int(r.prompt_ids[-1]))
        self.samplings.append(r.sampling)
        self.rules.append(r.rule or RuleSpec("greedy"))
        self.generators.append(r.generator if r.generator is not None else seeded(0))
        self.logprobs.append(r.logprobs)
        self.specs.append(st.spec)

    def prefill_step(self, budget: int, chunk: int | None = None) -> dict[str, Prefilled]:
        """ONE forward over the rows prefilled apart that feeds them their next prompt
        tokens, oldest first, at most ``chunk`` per row (default ``budget``) and
        ``budget`` in all. The rows whose prompt is then all in join the verified rows;
        returns ``{row id: Prefilled}`` of those."""
        if not self.prefilling or budget < 1:
            return {}
        order = list(self.prefilling)  # the staging runner's rows, in this order
        tokens = [torch.zeros(0, dtype=torch.long) for _ in order]
        fed: list[tuple[int, _Prefilling, int]] = []
        for b, rid in enumerate(order):
            st = self.prefilling[rid]
            n = min(st.total - st.done, chunk or budget, budget)
            if n < 1:
                break
            tokens[b] = torch.tensor(st.row.prompt_ids[st.done: st.done + n], dtype=torch.long)
            fed.append((b, st, n))
            budget -= n
        needed = any(st.needs_logits for _, st, _ in fed)
        logits = self.staging.forward(tokens, last_only=not needed)
        done = []
        for b, st, n in fed:
            feats = self.staging.features(st.spec)[b] if self.features else None
            st.absorb(logits[b] if needed else None, feats, n)
            if st.done == st.total:
                done.append(b)
        out = {}
        for b in sorted(done, reverse=True):  # highest first: the others keep their index
            st = self.prefilling.pop(order[b])
            self.runner.take_rows(self.staging, [b])
            self._join(st)
            out[st.row.rid] = st.result()
        return out

    def verify(self, items: list[tuple[str, TokenTree | dict | None]]
               ) -> list[VerifyResult | Exception]:
        """ONE target forward over the trees of the rows in ``items`` (row id, tree or its
        wire dict; None: the root alone), each judged by its own rule with its own rng
        and pruned to its accepted path. A row whose judging fails gets its exception in
        place of a result (its cache and root as before the call; the other rows are
        unaffected). KeyError for a row id that is not here."""
        rows = [_index(self.rids, rid) for rid, _ in items]
        if len(set(rows)) != len(rows):
            raise ValueError(f"rows: a request id appears twice in {[rid for rid, _ in items]}")
        trees = [TokenTree.from_wire(t) if isinstance(t, dict)
                 else t if t is not None else TokenTree(self.roots[b])
                 for (_, t), b in zip(items, rows, strict=True)]
        riders = self._board(max((len(t) for t in trees), default=0))
        first = len(self.rids)  # the riding rows' first runner row
        tokens = [torch.zeros(0, dtype=torch.long) for _ in range(self.runner.rows)]
        for j, st in enumerate(riders):
            tokens[first + j] = torch.tensor(st.row.prompt_ids[:-1], dtype=torch.long)
        positions: list[torch.Tensor | None] = [None] * self.runner.rows
        allowed: list[torch.Tensor | None] = [None] * self.runner.rows
        prefix = []
        for b, tree in zip(rows, trees, strict=True):
            if tree.tokens[0] != self.roots[b]:
                raise ValueError(f"tree: row {b}'s root token {tree.tokens[0]} is not its last "
                                 f"committed token {self.roots[b]}")
            n = self.runner.length(b)
            prefix.append(n)
            tokens[b] = tree.token_tensor()
            if not tree.is_chain():
                positions[b] = tree.position_ids(n)
                allowed[b] = tree.ancestor_matrix()  # + the whole prefix
        try:
            logits = self.runner.forward(tokens, positions, allowed)
        except BaseException:  # the riders wait for the next forward again
            self.runner.drop(list(range(first, first + len(riders))))
            self.riding = riders + self.riding
            raise
        for j, st in enumerate(riders):  # their prompts are in: they join
            feats = self.runner.features(st.spec)[first + j] if self.features else None
            st.absorb(logits[first + j], feats, st.total)
            self._join(st)
            self.ridden[st.row.rid] = st.result()
        # every row's rule reduces its logits on the device; ONE fetch for the batch
        prepared: list = []
        for b, tree in zip(rows, trees, strict=True):
            try:
                prepared.append(prepare_rule(self.rules[b], tree, logits[b, :len(tree)],
                                             self.samplings[b]))
            except Exception as exc:  # a fault boundary: this row only
                prepared.append(exc)
        fetched = iter(fetch_nested([x for x in prepared if not isinstance(x, Exception)]))
        out: list[VerifyResult | Exception] = []
        asked: list[tuple[int, int, TokenTree, list[int]]] = []  # rows that want logprobs
        for i, (b, tree) in enumerate(zip(rows, trees, strict=True)):
            try:  # one row's failure (its rule, its rng) is its own: the others go on
                if isinstance(prepared[i], Exception):
                    raise prepared[i]
                verdict = judge_rule(self.rules[b], tree, next(fetched), self.samplings[b],
                                     self.generators[b])
            except Exception as exc:  # a fault boundary: this row only
                self.runner.keep(b, list(range(prefix[i])))  # the row as before the round
                out.append(exc)
                continue
            self.runner.keep(b, list(range(prefix[i])) + [prefix[i] + j for j in verdict.path])
            new = committed_tokens(tree, verdict)
            self.roots[b] = new[-1]
            feats = (self.runner.features(self.specs[b])[b, verdict.path].clone()
                     if self.features else None)
            if self.logprobs[b] is not None:  # node path[i]'s row predicted new[i]
                asked.append((len(out), b, verdict.path, new))
            out.append(VerifyResult(verdict.path, new, verdict.accepted, verdict.evaluated,
                                    tree.num_drafted, feats))
        if asked:  # the log-probs of every row that asked: one more fetch
            inputs = [logprob_inputs(logits[b, path], new, self.logprobs[b])
                      for _, b, path, new in asked]
            for (j, _, _, new), host in zip(asked, fetch_nested(inputs), strict=True):
                out[j].logprobs = logprob_entries(new, *host)
        self.runner.maybe_compact()
        return out

    def generator(self, rid: str) -> torch.Generator:
        """Row ``rid``'s random generator (KeyError if it is not here)."""
        return self.generators[_index(self.rids, rid)]

    def length(self, rid: str) -> int:
        """KV positions row ``rid`` holds."""
        return self.runner.length(_index(self.rids, rid))

    def end(self, rid: str) -> bool:
        """Row ``rid`` leaves (False if it was not here)."""
        riding = [st for st in self.riding if st.row.rid == rid]
        if riding:  # its prompt is not in any cache yet
            self.riding.remove(riding[0])
            return True
        if rid in self.prefilling:  # not verified yet: its cache is the staging runner's
            self.staging.drop([list(self.prefilling).index(rid)])
            del self.prefilling[rid]
            return True
        if rid not in self.rids:
            return False
        b = self.rids.index(rid)
        self.runner.drop([b])
        for state in (self.rids, self.roots, self.samplings, self.rules, self.generators,
                      self.logprobs, self.specs):
            state.pop(b)
        if not self.rids:
            self.runner.release_rows()  # an idle pool holds no cache
        return True


def sampling_key(sampling: SamplingParams) -> str:
    """The draft pool's group of a request: its sampling settings."""
    return json.dumps([sampling.temperature, sampling.top_k, sampling.top_p])


class _DraftGroup:
    def __init__(self, drafter: BatchDrafter, sampling: SamplingParams) -> None:
        self.drafter, self.sampling = drafter, sampling
        self.rids: list[str] = []
        self.generators: list[torch.Generator] = []
        self.calls0: list[int] = []  # the drafter's forwards when each row joined


class DraftPool:
    """The draft side of every live request: per sampling setting, one batched drafter
    with a row per request.

    It can also draft a request's next round while the target verifies this one
    (:meth:`draft_ahead`, :mod:`speclab.decoding.lookahead`): :meth:`propose` then hands
    out the tree drafted ahead when the verdict matches its guess."""

    def __init__(self, make: Callable[[SamplingParams], BatchDrafter],
                 ahead_warmup: int = 8, ahead_min_hit_rate: float = 0.2) -> None:
        """``make(sampling)``: a fresh batched drafter for requests with ``sampling``;
        ``ahead_warmup`` / ``ahead_min_hit_rate``: drafting ahead stops for a request
        whose hit rate after that many rounds is below the rate, or whose hits saved less
        time than drafting ahead cost (:meth:`~speclab.decoding.lookahead.RowAhead.
        worth_it`)."""
        if ahead_warmup < 1 or not 0.0 <= ahead_min_hit_rate <= 1.0:
            raise ValueError("ahead_warmup must be >= 1 and ahead_min_hit_rate in [0, 1], got "
                             f"{ahead_warmup}, {ahead_min_hit_rate}")
        self.make = make
        self.groups: dict[str, _DraftGroup] = {}
        self.where: dict[str, str] = {}  # request id -> its group
        self.ahead: dict[str, RowAhead] = {}  # request id -> its drafting-ahead state
        self.ahead_warmup, self.ahead_min_hit_rate = ahead_warmup, ahead_min_hit_rate
        self._done_calls = 0  # forwards of groups that are gone

    def __contains__(self, rid: str) -> bool:
        return rid in self.where

    def __len__(self) -> int:
        return len(self.where)

    def join(self, rows: list[NewRow]) -> None:
        """New rows (a request id that is already here starts over); the rows of one
        group are prefilled together."""
        for r in rows:
            self.end(r.rid)
        by_group: dict[str, list[NewRow]] = {}
        for r in rows:
            by_group.setdefault(sampling_key(r.sampling), []).append(r)
        for key, group_rows in by_group.items():
            if key not in self.groups:
                sampling = group_rows[0].sampling
                self.groups[key] = _DraftGroup(self.make(sampling), sampling)
            g = self.groups[key]
            generators = [r.generator if r.generator is not None else seeded(0)
                          for r in group_rows]
            g.drafter.join([r.prompt_ids for r in group_rows], generators,
                           [r.prefill_top for r in group_rows],
                           [r.features for r in group_rows])
            for r, gen in zip(group_rows, generators, strict=True):
                g.rids.append(r.rid)
                g.generators.append(gen)
                g.calls0.append(g.drafter.calls)
                self.where[r.rid] = key
                self.ahead[r.rid] = RowAhead(committed=len(r.prompt_ids))

    def propose(self, items: list[tuple[str, list[int] | None, list[int], int,
                                        torch.Tensor | None]]) -> list[Proposal | Exception]:
        """Per item (request id, last accepted ``path``, committed tokens ``new``,
        ``budget``, the target's features on the path): commit the last round, then
        draft a tree (a batched draft forward per step over each group's rows). A request
        whose next round was drafted ahead (:meth:`draft_ahead`) and whose verdict
        matched the guess gets that tree at once (``Proposal.ahead`` True; False: a miss,
        drafted again). Returns per item the tree (None at budget 0) and the request's
        draft forwards so far, or the exception its group's drafter raised (the other
        groups are unaffected). KeyError for a request id that is not here."""
        out: dict[str, Proposal] = {}
        by_group: dict[str, list[tuple]] = {}
        for rid, path, new, budget, f in items:
            if rid not in self.where:
                raise KeyError(rid)
            g, st = self.groups[self.where[rid]], self.ahead[rid]
            had = st.pending
            tree = st.take(path, new, budget) if had is not None else None
            if tree is not None:  # a hit: the drafter already holds the guessed path
                st.record(True)
                if f is not None:  # drafted on its own features: the target's come later
                    st.sync_at = st.committed if st.sync_at is None else st.sync_at
                    st.unsynced += had.tokens
                    st.deferred.append(f)
                st.committed += len(had.tokens)
                out[rid] = Proposal(tree, g.drafter.calls - g.calls0[g.rids.index(rid)],
                                    ahead=True)
                continue
            mine, tokens = st.translate(path, new)
            if had is not None:
                st.record(False)
            if had is not None or st.sync_at is not None:
                # forget the guess (and what was drafted on the drafter's own features):
                # the drafter takes the committed tokens since, with the target's features
                back = st.committed if st.sync_at is None else st.sync_at
                g.drafter.rewind(g.rids.index(rid), back)
                mine, tokens = None, st.unsynced + tokens
                if st.deferred:
                    f = torch.cat([*st.deferred, f]) if f is not None else torch.cat(st.deferred)
                st.committed, st.sync_at, st.unsynced, st.deferred = back, None, [], []
            by_group.setdefault(self.where[rid], []).append(
                (rid, mine, tokens, budget, f, None if had is None else False))
        for key, group_items in by_group.items():
            g = self.groups[key]
            try:  # a group's failure is its own: the other groups' rows go on
                trees = self._draft(g, group_items)
            except Exception as exc:  # a fault boundary: this group's rows only
                for rid, *_ in group_items:
                    out[rid] = exc
                continue
            for rid, _, tokens, budget, _, ahead in group_items:
                b = g.rids.index(rid)
                st = self.ahead[rid]
                st.committed += len(tokens)
                st.sent_tree(trees[b], budget)
                out[rid] = Proposal(trees[b], g.drafter.calls - g.calls0[b], ahead=ahead)
        return [out[item[0]] for item in items]

    @staticmethod
    def _draft(g: _DraftGroup, items: list[tuple], deeper: int = 0) -> list:
        """One ``propose`` call of group ``g``'s drafter for ``items`` (request id, path
        and tokens as the drafter sees them, budget, features, ...); the group's other
        rows keep their state."""
        n = len(g.rids)
        paths: list[list[int] | None] = [None] * n
        news: list[list[int]] = [[] for _ in range(n)]
        budgets, feats = [0] * n, [None] * n
        for rid, path, new, budget, f, *_ in items:
            b = g.rids.index(rid)
            paths[b], news[b], budgets[b], feats[b] = path, list(new), budget, f
        return g.drafter.propose(paths, news, budgets, feats, deeper) if deeper else \
            g.drafter.propose(paths, news, budgets, feats)

    def can_draft_ahead(self, rid: str) -> bool:
        """Whether request ``rid``'s next round may be drafted ahead: greedy drafting, a
        drafter that can forget a wrong guess (``BatchDrafter.rewindable``), and drafting
        ahead still paying off for it."""
        g = self.groups[self.where[rid]]
        st = self.ahead[rid]
        if st.on and not st.worth_it(self.ahead_warmup, self.ahead_min_hit_rate):
            st.on = False
        return st.on and g.sampling.greedy and g.drafter.rewindable

    def draft_ahead(self, rids: list[str]) -> list[str]:
        """Draft the next round of requests ``rids`` (those just sent to the target that
        :meth:`can_draft_ahead`) assuming their sent tree's likeliest path is accepted,
        in one batched drafter call per group. Returns the request ids drafted ahead. A
        group whose drafter fails drafts nothing ahead (its rows draft as usual next)."""
        by_group: dict[str, list[tuple]] = {}
        for rid in rids:
            if rid not in self.where or not self.can_draft_ahead(rid):
                continue
            plan = self.ahead[rid].plan()
            if plan is None:
                continue
            path, mine, tokens, levels = plan
            by_group.setdefault(self.where[rid], []).append((rid, mine, tokens, levels, None,
                                                             path))
        done = []
        for key, group_items in by_group.items():
            g = self.groups[key]
            try:  # one level more: the bonus guesses, then a tree of the method's length
                trees = self._draft(g, group_items, deeper=1)
            except Exception:  # the rows rewind on their next round and draft as usual
                trees = [None] * len(g.rids)
            for rid, _, tokens, _, _, path in group_items:
                self.ahead[rid].pending = Ahead(path, tokens, trees[g.rids.index(rid)])
                done.append(rid)
        return done

    def ahead_stats(self, rid: str) -> RowAhead:
        """Request ``rid``'s drafting-ahead state and statistics (KeyError if not here)."""
        return self.ahead[rid]

    def length(self, rid: str) -> int:
        """Positions of draft state request ``rid`` holds."""
        g = self.groups[self.where[rid]]
        return g.drafter.cached_tokens(g.rids.index(rid))

    def end(self, rid: str) -> bool:
        """Request ``rid`` leaves (False if it was not here)."""
        key = self.where.pop(rid, None)
        if key is None:
            return False
        g = self.groups[key]
        b = g.rids.index(rid)
        g.drafter.drop([b])
        self.ahead.pop(rid, None)
        for state in (g.rids, g.generators, g.calls0):
            state.pop(b)
        if not g.rids:
            self._done_calls += g.drafter.calls
            g.drafter.release()
            del self.groups[key]
        return True

    def release(self) -> None:
        """Every row leaves (the run is over, or failed)."""
        for rid in list(self.where):
            self.end(rid)

    def generator(self, rid: str) -> torch.Generator:
        """Request ``rid``'s random generator (KeyError if it is not here)."""
        g = self.groups[self.where[rid]]
        return g.generators[g.rids.index(rid)]

    def sampling(self, rid: str) -> SamplingParams:
        """Request ``rid``'s sampling settings (KeyError if it is not here)."""
        return self.groups[self.where[rid]].sampling

    @property
    def calls(self) -> int:
        """Draft model forwards of every group so far (a batched forward counts once)."""
        return self._done_calls + sum(g.drafter.calls for g in self.groups.values())
