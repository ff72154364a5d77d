"""The verbs interposer against a STAND-IN libibverbs.so.1 (ark.integrations.verbs_standin).

The stand-in is not a verbs implementation: it exports libibverbs' versioned symbols and
records every ibv_modify_qp it receives, so these tests see exactly what an engine's call
turned into after the interposer, on a machine without RDMA devices. What a NIC then puts on
the wire is scripts/roce-wire-check.py's business (Soft-RoCE), not theirs.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from ark.core.roce import flow_label_for_sport, udp_sport
from ark.integrations import verbs, verbs_standin
from ark.integrations.preload import PreloadError

PEER, OTHER = "10.0.1.1", "10.0.2.1"
PORTS = [49153, 50000, 60001]


def engine(built: tuple[Path, Path], *args: str, preload: bool = True, **env: str) -> list[dict]:
    """The C engine program (linked against the stand-in like an engine): its RTR records."""
    lib, folder = built
    e = verbs_standin.env(folder, preload_lib=lib if preload else None)
    e.pop(verbs.RULES_ENV, None)
    res = subprocess.run([str(folder / verbs_standin.ENGINE_BIN), *args], capture_output=True, text=True,
                         env={**e, **env}, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    return [json.loads(line) for line in res.stdout.splitlines()]


def run(built: tuple[Path, Path], code: str, preload: bool = True) -> object:
    """``code`` in a fresh Python process on the stand-in (``eng``: the engine; ``lib``, ``S``:
    the interposer's path and the stand-in folder); its last printed line, as JSON."""
    lib, folder = built
    head = (f"import json, threading\nfrom pathlib import Path\nfrom ark.integrations import verbs, verbs_standin\n"
            f"from ark.integrations.verbs import QpRule\nlib, S = {str(lib)!r}, Path({str(folder)!r})\n"
            f"eng = verbs_standin.Engine(S)\nPEER, OTHER, PORTS = {PEER!r}, {OTHER!r}, {PORTS!r}\n")
    env = verbs_standin.env(folder, preload_lib=lib if preload else None)
    res = subprocess.run([sys.executable, "-c", head + textwrap.dedent(code)], capture_output=True, text=True,
                         env=env, timeout=60, check=False)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def labels(records: list[dict]) -> list[int]:
    return [r["flow_label"] for r in records]


def test_an_engine_program_gets_leased_labels_from_the_environment_only_when_preloaded(built, tmp_path) -> None:
    rules = verbs.rules_env({PEER: verbs.Laned([49153, 50000], [0, 1])})
    assert labels(engine(built, "linked", PEER, "3", preload=False, ARK_VERBS_RULES=rules)) == [0, 0, 0]
    assert labels(engine(built, "linked", PEER, "3")) == [0, 0, 0]  # preloaded, no rule: untouched
    log = tmp_path / "qps.jsonl"
    got = engine(built, "linked", PEER, "3", ARK_VERBS_RULES=rules, ARK_VERBS_LOG=str(log))
    # QPs take the lanes in turn (one part of the lease each), each the next port of its lane.
    assert labels(got) == [flow_label_for_sport(49153), flow_label_for_sport(50000), flow_label_for_sport(49153)]
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(e["qp_num"], e["port"], e["flow_label"], e["lane"], e["kind"]) for e in logged] == [
        (got[0]["qp_num"], 49153, 1, 0, "steered"), (got[1]["qp_num"], 50000, 848, 1, "steered"),
        (got[2]["qp_num"], 49153, 1, 0, "steered")]
    assert {e["peer"] for e in logged} == {f"::ffff:{PEER}"}


@pytest.mark.parametrize("why, args", [
    ("another peer", ["linked", OTHER, "2"]),
    ("a UD QP", ["linked", PEER, "2", "4", "1"]),
    ("no GRH", ["linked", PEER, "2", "2", "0"]),
    ("a UC QP is steered", ["linked", PEER, "1", "3", "1"]),
])
def test_what_passes_through_untouched(built, why, args) -> None:
    got = engine(built, *args, ARK_VERBS_RULES=f"{PEER}=49153")
    assert labels(got) == ([1] if why.startswith("a UC") else [0] * len(got)), why


def _rules_run(built: tuple[Path, Path], rules: str, qps: int = 1, **env: str) -> tuple[list[int], str]:
    """The engine program under ``ARK_VERBS_RULES=rules``, QPs towards PEER: (labels, stderr)."""
    lib, folder = built
    res = subprocess.run([str(folder / verbs_standin.ENGINE_BIN), "linked", PEER, str(qps)], capture_output=True,
                         text=True, env={**verbs_standin.env(folder, preload_lib=lib), "ARK_VERBS_RULES": rules, **env},
                         timeout=20, check=False)
    assert res.returncode == 0, res.stderr
    return labels([json.loads(x) for x in res.stdout.splitlines()]), res.stderr


def test_a_bad_rules_variable_says_why_in_one_line_and_steers_nothing(built) -> None:
    got, err = _rules_run(built, f"{PEER}=1234")
    assert got == [0]
    assert err.strip() == (f"ark verbs: ARK_VERBS_RULES: {PEER}: ports must be 49152..65535[/LANE 0..255] "
                           "(1 of 1 rules malformed); none installed")


@pytest.mark.parametrize("rules, why", [
    (f"{PEER}=49153/", f"{PEER}: ports must be 49152..65535[/LANE 0..255] (1 of 1 rules malformed)"),  # no lane
    (f"{PEER}=", f"{PEER}: ports must be 49152..65535[/LANE 0..255] (1 of 1 rules malformed)"),  # no port at all
    (f"{PEER}=" + ",".join(["49153"] * 4097), f"{PEER}: at most 4096 ports per peer (1 of 1 rules malformed)"),
    (";".join(f"10.0.9.{i}=49153" for i in range(64)) + f";{PEER}=49153", "at most 64 rules; got 65"),
])
def test_rules_the_variable_cannot_hold_are_refused_in_one_line(built, rules, why) -> None:
    got, err = _rules_run(built, rules)
    assert got == [0] and err.strip() == f"ark verbs: ARK_VERBS_RULES: {why}; none installed"


def test_a_partly_malformed_rules_variable_installs_nothing(built) -> None:
    # The valid rule for PEER comes first: it is not installed either (all or nothing).
    got, err = _rules_run(built, f"{PEER}=49153;10.0.3.1=80;{OTHER}=49153", qps=2)
    assert got == [0, 0]
    assert err.strip() == ("ark verbs: ARK_VERBS_RULES: 10.0.3.1: ports must be 49152..65535[/LANE 0..255] "
                           "(1 of 3 rules malformed); none installed")
    assert _rules_run(built, f"{PEER}=49153;{OTHER}=49153", qps=2) == ([1, 1], "")  # the same, all valid


def test_ten_thousand_bad_rules_are_one_bounded_line(built) -> None:
    noise = "\n\x1b[31m" + "z" * 500  # what a terminal would act on, and a long name
    rules = ";".join([f"{noise}=1", *(f"x{i}=1" for i in range(9_999)), f"{PEER}=49153"])
    got, err = _rules_run(built, rules)
    assert got == [0] and err.count("\n") == 1 and len(err) < 300, err[:400]
    assert err.endswith("(10000 of 10001 rules malformed); none installed\n") and "\x1b" not in err


def test_the_qp_log_is_never_a_fifo_a_device_or_a_symbolic_link(built, tmp_path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere.jsonl")
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO someone reads: open succeeds, fstat refuses
    cases = [(fifo, "not a regular file", True), (fifo, "not a regular file", False),
             (Path("/dev/null"), "not a regular file", False), (link, "a symbolic link", False)]
    for path, why, read in cases:
        if not read and reader >= 0:
            os.close(reader)  # now no one reads it: a blocking open() for writing would wait forever
            reader = -1
        t0 = time.monotonic()
        got, err = _rules_run(built, f"{PEER}=49153", ARK_VERBS_LOG=str(path))
        assert time.monotonic() - t0 < 10 and got == [1], err  # the rule holds; only the log is refused
        assert err.strip() == f"ark verbs: ARK_VERBS_LOG: {path}: {why}; QPs are not logged to a file"
    assert not (tmp_path / "elsewhere.jsonl").exists()
    # From Python the same path is one line too.
    out = run(built, f"""
        try:
            QpRule(PEER, log_path={str(fifo)!r})
        except verbs.VerbsError as e:
            print(json.dumps(str(e)))
    """)
    assert out == f"log_path: cannot open {fifo} (a regular file, not a link, FIFO or device)"


def test_a_terminal_named_as_the_qp_log_never_becomes_the_engines_controlling_terminal(built, tmp_path) -> None:
    # A session leader with no controlling terminal that opens a terminal without O_NOCTTY
    # may take it as its own (job-control signals, /dev/tty; Linux does so for a readable
    # open only, other kernels for any): the log is opened with O_NOCTTY, seen by strace.
    strace = shutil.which("strace")
    if strace is None:
        pytest.skip("no strace: the log's open flags cannot be seen")
    lib, folder = built
    controller, terminal = os.openpty()
    trace = tmp_path / "trace"
    try:
        name = os.ttyname(terminal)
        env = {**verbs_standin.env(folder, preload_lib=lib), "ARK_VERBS_RULES": f"{PEER}=49153", "ARK_VERBS_LOG": name}
        code = "print(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[4])"  # tty_nr
        res = subprocess.run([strace, "-f", "-e", "trace=open,openat", "-o", str(trace), sys.executable, "-c", code],
                             capture_output=True, text=True, env=env, timeout=60, check=False, start_new_session=True)
    finally:
        os.close(terminal)
        os.close(controller)
    if res.returncode != 0 and "ptrace" in res.stderr:
        pytest.skip(f"strace cannot trace here: {res.stderr.strip()[:200]}")
    assert res.returncode == 0 and res.stdout.strip() == "0", (res.stdout, res.stderr)
    assert "not a regular file; QPs are not logged to a file" in res.stderr
    (opened,) = [line for line in trace.read_text().splitlines() if f'"{name}"' in line]
    assert all(flag in opened for flag in ("O_NOCTTY", "O_NOFOLLOW", "O_NONBLOCK")), opened


def test_dlvsym_of_libibverbs_is_not_intercepted_but_nccl_ibverbs_lib_is(built) -> None:
    lib, _ = built
    rules = f"{PEER}=49153"
    # NCCL's way: dlopen + dlvsym from that handle. LD_PRELOAD cannot reach it.
    assert labels(engine(built, "dlvsym", "libibverbs.so.1", PEER, "2", ARK_VERBS_RULES=rules)) == [0, 0]
    # NCCL_IBVERBS_LIB naming the interposer: every symbol NCCL needs resolves (the rest through
    # its libibverbs.so.1 dependency) and ibv_modify_qp is the interposer's.
    assert labels(engine(built, "dlvsym", str(lib), PEER, "2", preload=False, ARK_VERBS_RULES=rules)) == [1, 1]


def test_thread_rules_process_rules_and_other_transitions(built) -> None:
    out = run(built, """
        rule = QpRule(PEER)
        rule.add_ports(PORTS[:2], [0, 1])
        res = {}
        with rule:
            eng.connect(PEER, 2)
            t = threading.Thread(target=lambda: res.setdefault("thread", eng.connect(PEER, 1)))
            t.start(); t.join()   # another thread: the rule is this thread's only
        with rule.installed():
            t = threading.Thread(target=lambda: res.setdefault("installed", eng.connect(PEER, 1)))
            t.start(); t.join()   # installed: every thread's
        eng.connect(PEER, 1)      # neither
        recs = eng.records()
        print(json.dumps({"rtr": [r.flow_label for r in recs if r.state == verbs_standin.QPS_RTR],
                          "others": sorted({(r.state, r.flow_label) for r in recs if r.state != verbs_standin.QPS_RTR}),
                          "qps": [[q.qp_num, q.port, q.flow_label, q.lane, q.steered] for q in rule.qps()],
                          "stats": list(rule.stats().__dict__.values()), "res": res}))
    """)
    fl = [flow_label_for_sport(p) for p in PORTS]
    assert out["rtr"] == [fl[0], fl[1], 0, fl[0], 0]
    assert out["others"] == [[verbs_standin.QPS_INIT, 0], [verbs_standin.QPS_RTS, 0]]  # untouched
    assert [q[1:] for q in out["qps"]] == [[49153, fl[0], 0, True], [50000, fl[1], 1, True], [49153, fl[0], 0, True]]
    assert out["qps"][2][0] == out["res"]["installed"][0]
    assert out["stats"] == [3, 0, 0, 0, 2]


def test_recorded_only_no_port_left_and_failed_rtr(built) -> None:
    out = run(built, """
        watch, empty, rule = QpRule(PEER, steer=False), QpRule(OTHER), QpRule(PEER)
        rule.add_ports(PORTS)
        with watch:
            eng.connect(PEER, 1)
        with empty:
            eng.connect(OTHER, 1)
        with rule:
            eng.connect(PEER, 1)
            eng.fail_next_rtr(22)
            try:
                eng.connect(PEER, 1)
            except verbs.VerbsError as e:
                failed = str(e)
        print(json.dumps({"watch": [[q.qp_num, q.dest_qp_num, q.port, q.flow_label, q.steered] for q in watch.qps()],
                          "empty": [[q.port, q.steered] for q in empty.qps()], "empty_stats": empty.stats().no_port,
                          "rule": [q.port for q in rule.qps()], "failed": failed,
                          "rtr": [r.flow_label for r in eng.rtrs()]}))
    """)
    qpn, dqpn, port, fl, steered = out["watch"][0]
    assert steered is None and fl == 0 and port == udp_sport(0, qpn, dqpn)  # the port the kernel derives
    assert out["empty"][0][1] is False and out["empty_stats"] == 1
    assert out["rule"] == [49153] and out["failed"] == "eng_connect: -122 (-2: the caller's attributes were changed)"
    # The failed RTR carried the next port's label (the engine may retry); only successes are logged.
    assert out["rtr"] == [0, 0, 1, 848]


def test_repath_needs_mlx5dv_and_a_live_qp_in_rts(built) -> None:
    out = run(built, """
        import ctypes
        rule = QpRule(PEER)
        rule.add_ports(PORTS)
        with rule:
            live = eng.connect(PEER, 1, keep=True)[0]
            gone = eng.connect(PEER, 1)[0]
            at_rtr = eng.connect(PEER, 1, at_rtr=True)[0]
        before = [verbs.can_repath(), rule.repath(live, 60001).why]
        ctypes.CDLL(str(S / "libmlx5.so.1"))   # the mlx5 provider, loaded locally as libibverbs does
        res = [rule.repath(q, 60001) for q in (live, gone, at_rtr)] + [rule.repath(live, 0)]
        qps = {q.qp_num: [q.port, q.repathed, q.alive] for q in rule.qps()}
        print(json.dumps({"before": before, "after": verbs.can_repath(), "res": [[r.moved, r.why] for r in res],
                          "qps": [qps[live], qps[gone], qps[at_rtr]], "repaths": rule.stats().repaths}))
    """)
    assert out["before"][0] is False and out["before"][1].startswith("mlx5dv_modify_qp_udp_sport: not available")
    assert out["after"] is True
    (moved, _), (_, why_gone), (_, why_rtr), (_, why_port) = out["res"]
    assert moved and why_gone.startswith("qp_num: no live QP") and why_port == "port: expected 1..65535"
    assert why_rtr.startswith("mlx5dv_modify_qp_udp_sport: Operation not supported")
    assert out["qps"] == [[60001, True, True], [50000, False, False], [60001, False, True]]
    assert out["repaths"] == 1


def test_nccl_route_from_python_shares_the_rules_and_labels_match_python(built) -> None:
    out = run(built, """
        lease_rule = QpRule(PEER)
        lease_rule.add_ports([49152, 65535], [0, 1])
        lease_rule.install()   # NCCL connects on its proxy thread: a process rule
        qpns = eng.dlvsym_connect(lib, PEER, 2)   # NCCL_IBVERBS_LIB=lib: same file, same instance
        from ark.core.roce import flow_label_for_sport
        mismatch = [p for p in range(0xC000, 0x10000) if verbs.flow_label(p) != flow_label_for_sport(p)]
        print(json.dumps({"qps": [[q.qp_num, q.port, q.flow_label] for q in lease_rule.qps()], "qpns": qpns,
                          "rtr": [r.flow_label for r in eng.rtrs()], "mismatch": mismatch,
                          "outside": [verbs.flow_label(p) for p in (0, 49151, 65536)]}))
    """, preload=False)
    assert out["qps"] == [[out["qpns"][0], 49152, 0x4001], [out["qpns"][1], 65535, 0x3FFF]]
    assert out["rtr"] == [0x4001, 0x3FFF] and out["mismatch"] == [] and out["outside"] == [0, 0, 0]


def test_rule_arguments_are_checked_in_one_line(built) -> None:
    out = run(built, """
        errs = []
        for f in (lambda: QpRule("nohost"), lambda: QpRule(PEER).add_ports([1234]),
                  lambda: QpRule(PEER).add_ports([49153], [0, 1]), lambda: QpRule(PEER).set_ports([65536])):
            try:
                f()
            except ValueError as e:
                errs.append(str(e).split(":")[0])
        r = QpRule(PEER)
        r.close()
        try:
            r.stats()
        except ValueError as e:
            errs.append(str(e))
        print(json.dumps(errs))
    """)
    assert out == ["peer", "ports", "lanes", "ports", "rule: already closed"]


def test_missing_headers_or_compiler_fail_in_one_line(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("ARK_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    with pytest.raises(verbs.VerbsError, match=r"^cc: building libarkverbs-"):
        verbs.library()
    err = verbs.build_error(PreloadError("cc: building x failed: ['verbs.c:38:10: fatal error: infiniband/verbs.h: "
                                         "No such file or directory']"))
    assert str(err) == "infiniband/verbs.h: not found; install libibverbs-dev (scripts/install-mooncake-deps.sh)"


def test_bench_verbs_per_qp_overhead_is_under_the_target(built, capsys) -> None:
    from ark.cli import main

    assert main(["bench", "verbs", "--calls", "300", "--rounds", "1", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert set(rec["modes"]) == {"plain", "idle", "other", "steered", "installed"}
    assert all(m["median_us"] > 0 for m in rec["modes"].values())
    assert rec["target_us"] == 10 and all(v < 10 for v in rec["overhead_us"].values()), rec["overhead_us"]


def test_ark_preload_verbs_runs_a_command_preloaded_or_for_nccl(built) -> None:
    lib, _ = built
    run_cmd = lambda *a: subprocess.run([sys.executable, "-m", "ark", "preload", *a], capture_output=True,  # noqa: E731
                                        text=True, timeout=60, check=False)
    assert run_cmd("--verbs").stdout.strip() == str(lib)
    p = run_cmd("--verbs", "--", "sh", "-c", 'echo "$LD_PRELOAD"')
    assert p.returncode == 0 and p.stdout.split()[0] == str(lib)
    p = run_cmd("--verbs", "--nccl", "--", "sh", "-c", 'echo "$NCCL_IBVERBS_LIB"')
    assert p.returncode == 0 and p.stdout.strip() == str(lib)
    p = run_cmd("--nccl")
    assert p.returncode == 2 and "--nccl: only with --verbs" in p.stderr


def test_a_binary_linked_before_ibverbs_1_1_calls_the_compatibility_symbol_and_is_not_reached(built) -> None:
    """The stand-in exports ibv_modify_qp at IBVERBS_1.0 and IBVERBS_1.1 as rdma-core does; the
    interposer defines only IBVERBS_1.1, so an old binary's QPs go out unsteered."""
    out = run(built, """
        rule = QpRule(PEER)
        rule.add_ports(PORTS)
        with rule:
            eng.connect(PEER, 1)       # today's binaries: IBVERBS_1.1
            eng.connect_1_0(PEER, 1)   # linked before 2006: IBVERBS_1.0
        print(json.dumps([[r.version, r.flow_label] for r in eng.rtrs()]))
    """)
    assert out == [["IBVERBS_1.1", flow_label_for_sport(PORTS[0])], ["IBVERBS_1.0", 0]]


def test_nested_rules_and_a_rule_closed_while_another_thread_is_inside_it(built) -> None:
    out = run(built, """
        outer, inner = QpRule(PEER), QpRule(PEER)
        outer.add_ports([PORTS[0]])
        inner.add_ports([PORTS[2]])
        with outer:
            with inner:
                eng.connect(PEER, 1)
            eng.connect(PEER, 1)   # the outer rule again
        eng.connect(PEER, 1)       # none
        entered, closed = threading.Event(), threading.Event()
        doomed = QpRule(PEER)
        doomed.add_ports([PORTS[1]])
        def inside():
            with doomed:
                entered.set()
                closed.wait()
                eng.connect(PEER, 1)   # its rule was freed meanwhile: never touched, plain
        t = threading.Thread(target=inside)
        t.start(); entered.wait(); doomed.close(); closed.set(); t.join()
        print(json.dumps([r.flow_label for r in eng.rtrs()]))
    """)
    fl = [flow_label_for_sport(p) for p in PORTS]
    assert out == [fl[2], fl[0], 0, 0]


def test_integers_ctypes_would_truncate_are_refused(built) -> None:
    out = run(built, """
        rule = QpRule(PEER)
        errs = []
        for call in (lambda: rule.repath(1, 2**32 + 60001), lambda: rule.repath(2**32 + 1, 60001),
                     lambda: verbs.flow_label(2**32 + 49153)):
            try:
                call()
                errs.append(None)
            except ValueError as e:
                errs.append(str(e))
        print(json.dumps(errs))
    """)
    assert out == ["port: expected an integer 1..65535; got 4295027297",
                   "qp_num: expected an integer 0..4294967295; got 4294967297",
                   "port: expected an integer 0..65535; got 4295016449"]
