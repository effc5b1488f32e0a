"""The replay check on synthetic traces: a clean one passes, and each kind of
disagreement between a trace and vgpud makes it fail (or lists the call)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from nvtrace_synth import GIB, MIB, Synth, cuda_like, device_params, memory_params

from tools.nvtrace import check as check_mod
from tools.nvtrace.__main__ import main
from tools.nvtrace.calls import Ioctl, events
from tools.nvtrace.check import check_traces, format_text
from tools.nvtrace.fmt import Block, Kind, Tag
from tools.nvtrace.model import HeldMemory
from tools.nvtrace.nvsim_src import read_nvsim
from tools.nvtrace.vgpud_api import QuotaStackMissing
from vgpud.nvidia.escapes import Escape, NvClass, iowr

NVSIM = read_nvsim()


def findings(s: Synth) -> list[str]:
    return [str(f) for f in check_traces([s.trace()]).all_findings]


def tree(s: Synth) -> tuple[int, int, int]:
    ctl = s.open("/dev/nvidiactl")
    client = s.alloc(ctl, 0, 0, NvClass.ROOT_CLIENT)
    return ctl, client, s.alloc(ctl, client, client, NvClass.DEVICE_0, device_params())


def test_clean_trace_passes_and_reports() -> None:
    s = Synth()
    info = cuda_like(s)
    res = check_traces([s.trace()], nvsim=NVSIM)
    assert res.ok, res.all_findings
    (lr,) = res.ledger
    assert lr.held_end == lr.ledger_end == info["held"]
    assert lr.after_close == 0 and lr.divergences == 0 and lr.replies == 1
    assert [(a.asked, a.returned) for a in res.allocations] == [
        (GIB, GIB), (4 * MIB, 4 * MIB), (6 * MIB, 6 * MIB), (2 * MIB, 2 * MIB)]
    assert res.unknown == {"CHECK_VERSION_STR (0xd2)": 1, "REGISTER_FD (0xc9)": 1,
                           "RM_ALLOC class 0xc8b5": 1, "RM_CONTROL control 0x20800110": 1}
    rows = {(r.kind, r.key): r for r in res.rows.values()}
    assert rows["class", NvClass.MEMORY_LOCAL_USER].calls == 2
    assert rows["class", NvClass.MEMORY_LOCAL_USER].up == 2
    assert rows["escape", Escape.RM_ALLOC].calls == 6
    text = format_text(res)
    assert "findings: 0 (check passed)" in text
    assert "0xc8b5  ?" in text and "NO    NO" in text  # unknown to vgpud and to nvsim


def test_size_the_driver_rounds_up_is_a_finding() -> None:
    s = Synth()
    cuda_like(s, mem_returned=GIB + 2 * MIB)
    found = findings(s)
    assert any("vgpud charges 1073741824 bytes (asked 1073741824), the driver returned "
               "1075838976" in f for f in found), found
    assert any("ledger charges" in f for f in found)  # and the ledger follows the ask


def test_call_the_driver_took_but_vgpud_cannot_decode() -> None:
    s = Synth()
    ctl, _, _ = tree(s)
    s.ioctl(ctl, Escape.RM_ALLOC, bytes(40), bytes(40))  # neither NVOS21 nor NVOS64
    assert any("does not decode" in f for f in findings(s))
    s2 = Synth()
    ctl, _, _ = tree(s2)
    s2.ioctl(ctl, Escape.RM_ALLOC, bytes(40), bytes(40), ret=-1, err=22)
    res = check_traces([s2.trace()])
    assert res.ok
    assert res.unknown == {"RM_ALLOC (0x2b) not decoded, rejected by the driver": 1}


def test_memory_the_filter_misses_is_a_ledger_divergence() -> None:
    s = Synth()
    ctl, client, dev = tree(s)
    # RM_ALLOC_MEMORY of device memory on the control node: the driver's answer
    # is synthetic here, the point is a charge the module's rules do not select.
    s.alloc_memory(ctl, client, dev, NvClass.MEMORY_LOCAL_USER, 8 * MIB)
    found = findings(s)
    assert any("ledger charges 0 bytes, the trace holds 8388608" in f for f in found), found


def test_policy_refusing_what_the_driver_did_is_a_finding() -> None:
    s = Synth()
    ctl, client, dev = tree(s)
    s.alloc(ctl, client, dev, NvClass.MEMORY_LOCAL_USER, memory_params(MIB), fault=True)
    found = findings(s)
    assert any("policy answers FAIL_STATUS (status 0x1e" in f for f in found), found
    assert any("size not recorded" in f for f in found)


def test_params_not_recorded_whole() -> None:
    s = Synth()
    ctl, _, _ = tree(s)
    cut = Block(Tag.ARG, False, 0x1000, 16, bytes(8), fault=True, err=14)
    s.w.write(Kind.IOCTL, ctl, args=(iowr(Escape.RM_FREE, 16), 0x1000), blocks=[cut])
    assert check_traces([s.trace()]).unknown == {}
    assert any("#3: escape 0x29: params not recorded whole" in f for f in findings(s))
    s.w.write(Kind.IOCTL, ctl, ret=-1, err=14, args=(iowr(Escape.RM_FREE, 16), 0x1000),
              blocks=[cut])  # a call that failed on its bad pointer is only listed
    assert check_traces([s.trace()]).unknown == {
        "RM_FREE (0x29) params unreadable, call failed": 1}


def test_truncated_trace_is_a_finding() -> None:
    s = Synth()
    cuda_like(s)
    t = s.trace()
    t.tail = 40
    assert any("incomplete last record" in str(f)
               for f in check_traces([t]).all_findings)


def test_ledger_skipped_without_the_quota_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(_gpus):
        raise QuotaStackMissing("pydantic: No module named 'pydantic'")

    monkeypatch.setattr(check_mod, "quota_stack", missing)
    s = Synth()
    cuda_like(s)
    res = check_traces([s.trace()])
    assert res.ok and not res.ledger
    assert "pydantic" in (res.ledger_skipped or "")
    assert "ledger: skipped" in format_text(res)


def test_held_memory_model() -> None:
    s = Synth()
    info = cuda_like(s)
    m = HeldMemory()
    for ev in events(s.trace()):
        if isinstance(ev, Ioctl):
            m.apply(ev, 1)
    assert m.held() == info["held"]
    m.close(1)  # the control file: its client, and all under it
    assert m.held() == 0


def test_client_free_cascades_and_dup_keeps_memory() -> None:
    s = Synth()
    ctl, client, dev = tree(s)
    mem = s.alloc(ctl, client, dev, NvClass.MEMORY_LOCAL_USER, memory_params(MIB))
    other = s.alloc(ctl, 0, 0, NvClass.ROOT_CLIENT)
    odev = s.alloc(ctl, other, other, NvClass.DEVICE_0, device_params())
    s.dup(ctl, other, odev, client, mem)
    s.free(ctl, client, client, client)  # the first client and its memory handle
    s.alloc(ctl, other, odev, NvClass.MEMORY_LOCAL_USER, memory_params(MIB))
    res = check_traces([s.trace()])
    assert res.ok, res.all_findings
    assert res.ledger[0].held_end == 2 * MIB  # the dup still names the first MiB


def test_nvsim_tables_are_found() -> None:
    assert {Escape.RM_ALLOC, Escape.RM_CONTROL, Escape.IOCTL_XFER_CMD} <= NVSIM.escapes
    assert {NvClass.ROOT_CLIENT, NvClass.MEMORY_LOCAL_USER} <= NVSIM.alloc_classes
    assert NvClass.MEMORY_SYSTEM in NVSIM.alloc_memory_classes
    assert 0x20801303 in NVSIM.controls and 0x30000001 in NVSIM.uvm


def test_cli_check_json_and_exit_status(tmp_path: Path, capsys) -> None:
    good, bad = Synth(), Synth()
    cuda_like(good)
    cuda_like(bad, mem_returned=2 * GIB)
    (tmp_path / "good").mkdir()
    (tmp_path / "good/a.nvtrace").write_bytes(good.trace_bytes())
    (tmp_path / "bad.nvtrace").write_bytes(bad.trace_bytes())
    assert main(["check", "--json", str(tmp_path / "r.json"), str(tmp_path / "good")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["ok"] is True
    assert main(["check", "--nvsim-src", "none", str(tmp_path / "bad.nvtrace")]) == 1
    assert "the driver returned 2147483648" in capsys.readouterr().out
    assert main(["dump", str(tmp_path / "bad.nvtrace")]) == 0
    (tmp_path / "junk.nvtrace").write_bytes(b"junk" * 20)
    assert main(["check", str(tmp_path / "junk.nvtrace")]) == 2


def test_uvm_mmap_goes_up_and_is_allowed() -> None:
    s = Synth()
    ctl, _, _ = tree(s)
    uvm = s.open("/dev/nvidia-uvm")
    s.mmap(uvm, 4 * MIB)
    s.close(uvm)
    s.close(ctl)
    res = check_traces([s.trace()])
    assert res.ok, res.all_findings
    assert res.ledger[0].after_close == 0
