"""uapi.py agrees with kmod/include/uapi/linux/vgpu.h: every #define and enum value."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from vgpud.kernel import uapi

HEADER = Path(__file__).resolve().parents[2] / "kmod/include/uapi/linux/vgpu.h"


def _c_int(expr: str, known: dict[str, int]) -> int:
    expr = re.sub(r"(?<=[0-9a-fA-F])[uUlL]+\b", "", expr.strip())
    for name, value in known.items():
        expr = re.sub(rf"\b{name}\b", str(value), expr)
    if not re.fullmatch(r"[0-9a-fA-Fx()<>+\-\s]+", expr):
        raise ValueError(expr)
    return int(eval(expr))  # digits and operators only, checked above


def parse_header(text: str) -> tuple[dict[str, int | str], dict[str, dict[str, int]]]:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    defines: dict[str, int | str] = {}
    known: dict[str, int] = {}
    enums: dict[str, dict[str, int]] = {}
    for name, body in re.findall(r"enum\s+(\w+)\s*\{(.*?)\}", text, flags=re.S):
        values, nxt = {}, 0
        for item in filter(None, (i.strip() for i in body.split(","))):
            key, _, expr = item.partition("=")
            nxt = _c_int(expr, known) if expr else nxt
            values[key.strip()] = nxt
            known[key.strip()] = nxt
            nxt += 1
        enums[name] = values
    for name, expr in re.findall(r"^#define\s+(\w+)[ \t]+(.+)$", text, flags=re.M):
        if expr.startswith('"'):
            defines[name] = expr.strip('"')
        else:
            defines[name] = known[name] = _c_int(expr, known)
    return defines, enums


DEFINES, ENUMS = parse_header(HEADER.read_text())

PY_DEFINES = {
    "VGPU_GENL_NAME": uapi.GENL_NAME,
    "VGPU_GENL_VERSION": uapi.GENL_VERSION,
    "VGPU_PROTO_VERSION": uapi.PROTO_VERSION,
    "VGPU_OFF_NONE": uapi.OFF_NONE,
    "VGPU_RULE_MATCH_MAX": uapi.RULE_MATCH_MAX,
    "VGPU_RULES_MAX": uapi.RULES_MAX,
    "VGPU_PARAMS_MAX": uapi.PARAMS_MAX,
    "VGPU_RULE_F_POST": uapi.RULE_F_POST,
    "VGPU_RULE_F_SHADOW": uapi.RULE_F_SHADOW,
    "VGPU_RULE_F_LEN_FIXED": uapi.RULE_F_LEN_FIXED,
    "VGPU_LIST_MAX": uapi.LIST_MAX,
    "VGPU_SCHED_MAX": uapi.SCHED_MAX,
    "VGPU_FILTER_OPEN": uapi.FILTER_OPEN,
    "VGPU_FILTER_UVM_MMAP": uapi.FILTER_UVM_MMAP,
    "VGPU_VERDICT_F_POST": uapi.VERDICT_F_POST,
    "VGPU_VERDICT_F_SCHED_OFF": uapi.VERDICT_F_SCHED_OFF,
    "VGPU_UPCALL_F_XFER": uapi.UPCALL_F_XFER,
    "VGPU_UPCALL_F_DATA_FAULT": uapi.UPCALL_F_DATA_FAULT,
    "VGPU_UPCALL_F_DATA_BIG": uapi.UPCALL_F_DATA_BIG,
    "VGPU_UPCALL_F_DATA2_FAULT": uapi.UPCALL_F_DATA2_FAULT,
    "VGPU_UPCALL_F_DATA2_BIG": uapi.UPCALL_F_DATA2_BIG,
    "VGPU_ERRNO_MAX": uapi.ERRNO_MAX,
    "VGPU_NESTED_MAX": uapi.NESTED_MAX,
    "VGPU_OBJ_MAX": uapi.OBJ_MAX,
    "VGPU_CMD_MAX": uapi.CMD_MAX,
    "VGPU_A_MAX": uapi.ATTR_MAX,
}

PY_ENUMS = {
    "vgpu_node": ("VGPU_NODE_", uapi.Node),
    "vgpu_upcall_kind": ("VGPU_UPCALL_", uapi.UpcallKind),
    "vgpu_verdict_action": ("VGPU_VERDICT_", uapi.VerdictAction),
    "vgpu_event_kind": ("VGPU_EVENT_", uapi.EventKind),
    "vgpu_cmd": ("VGPU_CMD_", uapi.Cmd),
    "vgpu_attr": ("VGPU_A_", uapi.Attr),
    "vgpu_sched_state": ("VGPU_SCHED_", uapi.SchedState),
    "vgpu_revoke_reason": ("VGPU_REVOKE_", uapi.RevokeReason),
    "vgpu_obj_op_kind": ("VGPU_OBJ_", uapi.ObjOpKind),
}


def test_every_define_is_mirrored() -> None:
    guards = {"_UAPI_LINUX_VGPU_H"}
    assert set(DEFINES) - guards == set(PY_DEFINES)


@pytest.mark.parametrize("name", sorted(PY_DEFINES))
def test_define(name: str) -> None:
    assert DEFINES[name] == PY_DEFINES[name]


def test_every_enum_is_mirrored() -> None:
    assert set(ENUMS) == set(PY_ENUMS)


@pytest.mark.parametrize("enum", sorted(PY_ENUMS))
def test_enum(enum: str) -> None:
    prefix, py = PY_ENUMS[enum]
    c_values = {k.removeprefix(prefix): v for k, v in ENUMS[enum].items()
                if not k.startswith("__")}
    assert c_values == {m.name: m.value for m in py}


def test_parser_sees_the_header() -> None:
    assert ENUMS["vgpu_attr"]["VGPU_A_EVENT"] == 10
    assert DEFINES["VGPU_OFF_NONE"] == 0xFFFFFFFF
