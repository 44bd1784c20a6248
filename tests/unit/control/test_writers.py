"""One writer per field of the coordinator's shared state (`bamboo.control.state`'s table).

An AST scan of `bamboo/control` (and of the decision tests' simulator, which must drive the
core through its API only) finds every write of a `RunContext` field: an assignment, an
augmented assignment or a `del` through `ctx.<field>` (or an alias of it, `r =
ctx.reconf`), and a mutating call on it (`ctx.losses.append`, `ctx.reconf.ending.discard`).
Each field must be written by its one owner module. The parts are built without
callbacks: `CoordinatorCore._build_parts` passes no lambda and no bound method.

The same rule beyond the context: a node's fields (the supervisor), each `Loss` (the
failure handler), the generation's plan (frozen, written by no one after it is made), a
step's buffers (`engine/engine.py`) and its report (frozen, built once by the engine).
"""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
CONTROL = ROOT / "src" / "bamboo" / "control"
SIMULATOR = ROOT / "tests" / "coordinator_sim.py"

OWNER = {
    **dict.fromkeys(("cfg", "store", "events", "display", "run_path", "param_counts",
                     "partition_costs", "clock", "t0", "resume_step", "resume_path"), "core"),
    **dict.fromkeys(("rc", "plan", "roles", "reconf"), "generations"),
    **dict.fromkeys(("committed", "losses", "layouts"), "steps"),
    "eval_losses": "results",
}
"""Field of `RunContext` -> the one module of bamboo/control that writes it."""

MUTATORS = {"append", "extend", "insert", "remove", "pop", "clear", "sort", "reverse", "add",
            "discard", "update", "setdefault", "difference_update", "intersection_update",
            "symmetric_difference_update", "popitem"}


def _written(node: ast.AST) -> list[ast.expr]:
    """What `node` writes: assignment targets, deleted names, the receiver of a mutator."""
    if isinstance(node, ast.Assign):
        return [t for target in node.targets
                for t in (target.elts if isinstance(target, ast.Tuple) else [target])]
    if isinstance(node, (ast.AugAssign, ast.AnnAssign)):
        return [node.target]
    if isinstance(node, ast.Delete):
        return list(node.targets)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
            and node.func.attr in MUTATORS:
        return [node.func.value]
    return []


def _is_ctx(node: ast.expr) -> bool:
    """`ctx`, `self.ctx`, `core.ctx`, ...: the run's context."""
    return (isinstance(node, ast.Name) and node.id == "ctx") or \
        (isinstance(node, ast.Attribute) and node.attr == "ctx")


def _field_of(node: ast.expr, aliases: dict[str, str]) -> str | None:
    """The context field `node` reaches into (`ctx.reconf.ending` -> reconf), if any."""
    while True:
        if isinstance(node, ast.Name):
            return aliases.get(node.id)
        if isinstance(node, ast.Subscript):
            node = node.value
            continue
        if not isinstance(node, ast.Attribute):
            return None
        if _is_ctx(node.value) and node.attr in OWNER:
            return node.attr
        node = node.value


def _aliases(fn: ast.AST) -> dict[str, str]:
    """Names bound to a context field in `fn` (`r = self.ctx.reconf`, `ctx, r = ..., ...`)."""
    out: dict[str, str] = {}
    for node in ast.walk(fn):
        if not isinstance(node, ast.Assign):
            continue
        for target in node.targets:
            pairs = [(target, node.value)]
            if isinstance(target, ast.Tuple) and isinstance(node.value, ast.Tuple):
                pairs = list(zip(target.elts, node.value.elts))
            for t, v in pairs:
                field = _field_of(v, {})
                if isinstance(t, ast.Name) and field is not None and isinstance(v, ast.Attribute):
                    out[t.id] = field
    return out


def writes(source: str) -> list[tuple[str, int]]:
    """(field, line) of every write of a context field in `source`."""
    found: list[tuple[str, int]] = []
    tree = ast.parse(source)
    scopes = [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    for fn in scopes:
        aliases = _aliases(fn)
        for node in ast.walk(fn):
            targets = _written(node)
            for t in targets:
                if isinstance(t, ast.Name):
                    continue  # rebinding a local name writes nothing shared
                field = _field_of(t, aliases)
                if field is not None:
                    found.append((field, node.lineno))
    return found


def writers() -> dict[str, dict[str, list[int]]]:
    """Field -> module -> the lines that write it."""
    out: dict[str, dict[str, list[int]]] = {}
    for path in sorted(CONTROL.glob("*.py")) + [SIMULATOR]:
        for field, line in writes(path.read_text()):
            out.setdefault(field, {}).setdefault(path.stem, []).append(line)
    return out


def test_each_shared_field_has_one_writer() -> None:
    found = writers()
    wrong = {field: mods for field, mods in found.items() if set(mods) != {OWNER[field]}}
    assert not wrong, f"fields written outside their owner (bamboo/control/state.py): {wrong}"
    # the scan sees the owners' writes (it is not blind)
    for field in ("roles", "reconf", "committed", "losses", "layouts", "eval_losses", "plan"):
        assert OWNER[field] in found.get(field, {}), field


def test_the_scan_catches_a_stray_write() -> None:
    """A second writer in any of the forms the scan knows is found."""
    stray = '''
def on_lost(self, n):
    ctx = self.ctx
    ctx.roles = n
    self.ctx.committed += 1
    del ctx.losses[3:]
    r = self.ctx.reconf
    r.why = "x"
    ctx.reconf.ending.discard(n)
    core.ctx.eval_losses.append(1)
    roles = ctx.roles  # a read
    local = 1
'''
    assert sorted(f for f, _ in writes(stray)) == sorted(
        ["roles", "committed", "losses", "reconf", "reconf", "eval_losses"])


def test_the_parts_are_built_without_callbacks() -> None:
    """`_build_parts` hands the parts objects, never a lambda or a bound method."""
    tree = ast.parse((CONTROL / "core.py").read_text())
    core = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "CoordinatorCore")
    methods = {n.name for n in core.body if isinstance(n, ast.FunctionDef)}
    build = next(n for n in core.body if isinstance(n, ast.FunctionDef) and n.name == "_build_parts")
    passed = [a for call in ast.walk(build) if isinstance(call, ast.Call)
              for a in list(call.args) + [k.value for k in call.keywords]]
    assert not [a for a in ast.walk(build) if isinstance(a, ast.Lambda)]
    for a in passed:
        chain = a
        while isinstance(chain, ast.Attribute):
            chain = chain.value
        if isinstance(a, ast.Attribute) and isinstance(chain, ast.Name) and chain.id == "self":
            assert a.attr not in methods, f"{ast.unparse(a)} passed as a callback"
            assert isinstance(a.value, ast.Name), f"{ast.unparse(a)}: a part's member passed"
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Lambda)], "a lambda in core.py"


NODE_OWNER = {**dict.fromkeys(("state", "kill_sent", "kill_at", "exited", "process",
                               "trace_node", "own_processor", "device_slot"), "nodes"),
              "rank": "generations"}
"""Field of a `nodes.Node` -> the one module that writes it (its `Supervisor`, or for the
rank in the current generation `Generations.enter`)."""


def node_writes(source: str) -> list[tuple[str, int]]:
    """(field, line) of every assignment to a node's field through another object than
    `self` (`n.kill_sent = True`, `self.nodes.by_name(name).rank = r`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = node.targets if isinstance(node, ast.Assign) else \
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in targets:
            if isinstance(t, ast.Attribute) and t.attr in NODE_OWNER and not (
                    isinstance(t.value, ast.Name) and t.value.id == "self"):
                found.append((t.attr, node.lineno))
    return found


def test_each_node_field_has_one_writer() -> None:
    """A node's state, kill, trace node, readiness: written by the supervisor only (its
    rank by the generations part); the other parts call the supervisor's methods."""
    found: dict[str, dict[str, list[int]]] = {}
    for path in sorted(CONTROL.glob("*.py")):
        for field, line in node_writes(path.read_text()):
            found.setdefault(field, {}).setdefault(path.stem, []).append(line)
    wrong = {f: mods for f, mods in found.items() if set(mods) != {NODE_OWNER[f]}}
    assert not wrong, f"node fields written outside their owner: {wrong}"
    assert {"state", "kill_sent", "rank"} <= set(found)
    assert node_writes("def f(n):\n    n.kill_sent = True\n") == [("kill_sent", 2)]


def test_the_core_writes_no_parts_field() -> None:
    """The core hands news on through the parts' methods: it never assigns to (or mutates)
    a part's attribute (`self.gens.checkpoint_due = True`, `self.nodes.beats[i] = t`)."""
    tree = ast.parse((CONTROL / "core.py").read_text())
    build = next(n for n in ast.walk(tree)
                 if isinstance(n, ast.FunctionDef) and n.name == "_build_parts")
    parts = {t.attr for n in ast.walk(build) if isinstance(n, ast.Assign) for t in n.targets
             if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
             and t.value.id == "self"}
    assert {"nodes", "steps", "gens", "failures", "preemptions"} <= parts

    def into_part(t: ast.expr) -> bool:
        while isinstance(t, (ast.Attribute, ast.Subscript)):
            inner = t.value
            if isinstance(t, ast.Attribute) and isinstance(inner, ast.Attribute) and \
                    isinstance(inner.value, ast.Name) and inner.value.id == "self" and \
                    inner.attr in parts:
                return True
            t = inner
        return False

    bad = []
    for n in ast.walk(tree):
        targets = n.targets if isinstance(n, (ast.Assign, ast.Delete)) else \
            [n.target] if isinstance(n, ast.AugAssign) else \
            [n.func.value] if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) \
            and n.func.attr in MUTATORS else []
        bad += [f"{n.lineno}: {ast.unparse(t)}" for t in targets if into_part(t)]
    assert not bad, bad


LOSS_FIELDS = {"handled_as", "pause_s", "reconfiguration_s", "repaired", "in_flight",
               "written", "shadow", "counts", "phase", "active_before"}
"""The fields of a `state.Loss` a part changes after making it (names no other object of
bamboo/control writes)."""


def attribute_writes(source: str, fields: set[str]) -> list[tuple[str, int, str]]:
    """(field, line, receiver) of every write of `<receiver>.<field>` in `source`: an
    assignment, an augmented assignment, a `del`, or a mutating call on it (or on an item
    of it); a receiver is the expression before the field (`loss`, `self.ctx.plan`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        targets = _written(node)
        for t in targets:
            while isinstance(t, ast.Subscript):
                t = t.value
            if isinstance(t, ast.Attribute) and t.attr in fields:
                found.append((t.attr, node.lineno, ast.unparse(t.value)))
    return found


def test_each_loss_is_written_by_the_failure_handler_alone() -> None:
    """Every `Loss` is written by `failures.FailureHandler` only; the generations part
    returns the losses a new generation covers, and the core hands them on."""
    found: dict[str, set[str]] = {}
    for path in sorted(CONTROL.glob("*.py")):
        for field, _, receiver in attribute_writes(path.read_text(), LOSS_FIELDS):
            if receiver != "self":
                found.setdefault(path.stem, set()).add(field)
    assert set(found) == {"failures"}, f"a Loss written outside failures.py: {found}"
    assert {"handled_as", "pause_s", "written"} <= found["failures"]  # the scan sees them
    stray = "def f(gens, r):\n    for x in r.lost:\n        x.handled_as = 1\n" \
            "    r.lost[0].counts.update(a=1)\n"
    assert [(f, line) for f, line, _ in attribute_writes(stray, LOSS_FIELDS)] == [
        ("handled_as", 3), ("counts", 4)]


def test_a_generation_plan_is_frozen_and_never_written() -> None:
    """A plan is complete when made: frozen, and no module writes a field of one (a
    receiver named `plan`, or an attribute `.plan`) after it is made."""
    import dataclasses

    from bamboo.plan.planner import GenerationPlan

    fields = {f.name for f in dataclasses.fields(GenerationPlan)}
    plan = GenerationPlan(gen=0, epoch=0, members=["n0"], pipelines=1, stages=1,
                          parts=[[0, 2]], start_step=0)
    try:
        plan.fired_kills = ["0:0@1"]  # type: ignore[misc]  # the write the test expects refused
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("GenerationPlan is not frozen")
    assert GenerationPlan.from_json(plan.to_json()) == plan

    def plans(receiver: str) -> bool:
        return receiver.split(".")[-1].endswith("plan") or receiver == "planned"

    bad = [f"{path.relative_to(ROOT)}:{line}: {receiver}.{field}"
           for path in sorted((ROOT / "src" / "bamboo").rglob("*.py"))
           for field, line, receiver in attribute_writes(path.read_text(), fields)
           if plans(receiver)]
    assert not bad, f"a generation plan written after it was made: {bad}"
    stray = "def enter(self, plan):\n    plan.stepwise = True\n    self.ctx.plan.holes.append(1)\n"
    assert [(f, r) for f, _, r in attribute_writes(stray, fields) if plans(r)] == [
        ("stepwise", "plan"), ("holes", "self.ctx.plan")]


ENGINE = ROOT / "src" / "bamboo" / "engine"
STEP_NAMES = {"s", "self.s", "scratch"}
"""What the engine's modules call a `StepState` (a parameter annotated so is named `s`)."""
STEP_METHODS = {"restart", "adopt", "received", "forwarded", "apply"}
"""`StepState`'s own methods that write it."""


def test_the_engine_alone_writes_a_step() -> None:
    """A step's buffers (`StepState`) are written in engine.py only (directly, or through
    the StepState's own methods, which write `self` in step.py): the transfers, a forward,
    the transport and a failover return what they produce or receive."""
    import dataclasses

    from bamboo.engine.step import StepState

    fields = {f.name for f in dataclasses.fields(StepState)}
    found: dict[str, set[str]] = {}
    for path in sorted((ROOT / "src" / "bamboo").rglob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):  # the name makes the scan sound: a step is always `s`
            if isinstance(node, ast.arg) and node.annotation is not None and \
                    ast.unparse(node.annotation) == "StepState":
                assert node.arg == "s", f"{path.name}:{node.lineno}: a step named {node.arg}"
        writes = {f for f, _, receiver in attribute_writes(path.read_text(), fields)
                  if receiver in STEP_NAMES}
        calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call)
                 and isinstance(n.func, ast.Attribute) and n.func.attr in STEP_METHODS
                 and ast.unparse(n.func.value) in STEP_NAMES}
        if writes | calls:
            found[str(path.relative_to(ENGINE.parent))] = writes | calls
    assert set(found) == {"engine/engine.py"}, f"a step written outside the engine: {found}"
    assert {"inputs", "out_grads", "outputs", "apply", "forwarded"} <= found["engine/engine.py"]


def test_a_step_report_is_built_once_by_the_engine() -> None:
    """`StepReport` is frozen and made in engine.py alone (at the step's commit)."""
    import dataclasses

    from bamboo.protocol.votes import StepReport

    report = StepReport(step=0, rank=0, stages=[])
    try:
        report.brc = 1  # type: ignore[misc]  # the write the test expects refused
    except dataclasses.FrozenInstanceError:
        pass
    else:
        raise AssertionError("StepReport is not frozen")
    makers = {str(path.relative_to(ENGINE.parent))
              for path in (ROOT / "src" / "bamboo").rglob("*.py")
              for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
              and ast.unparse(n.func).split(".")[-1] in ("StepReport", "replace")
              and "StepReport" in ast.unparse(n)}
    assert makers == {"engine/engine.py"}, makers
