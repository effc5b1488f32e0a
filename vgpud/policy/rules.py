"""Builders of the module's filter rules (struct vgpu_rule) for NVIDIA escapes.

A rule selects calls by escape, exact params size and a u32 key in the params
(object class, control command), and names the user pointer whose buffer the
module copies into the upcall: the control params by their paramsSize, the
alloc params by the size the driver reads for their class (ALLOC_PARAMS),
whatever NVOS21/NVOS64 paramsSize says.

Every builder takes ``post`` (a POST event after each allowed call) and
``shadow`` (the driver reads the module's checked copy of the params and the
buffer, so that what the policy decided on is what the driver acts on).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import groupby

from vgpud.kernel.cstruct import CStruct
from vgpud.kernel.uapi import Filter, Node, Rule, RuleNested
from vgpud.nvidia.escapes import FB_INFO_MAX_LIST_SIZE, Ctrl, Escape, NvClass
from vgpud.nvidia.layouts import (
    ALLOC_PARAMS,
    FB_INFO_ENTRY,
    NV2080_CTRL_FB_GET_INFO_PARAMS,
    NVOS00,
    NVOS02_WITH_FD,
    NVOS21,
    NVOS32,
    NVOS54,
    NVOS55,
    NVOS64,
)

__all__ = [
    "rm_alloc_any",
    "rm_alloc_channel_groups",
    "rm_alloc_classes",
    "rm_alloc_classes_bare",
    "rm_alloc_memory_any",
    "rm_alloc_memory_classes",
    "rm_control_cmds",
    "rm_control_fb_get_info",
    "rm_dup_object",
    "rm_free",
    "rm_vid_heap",
    "uvm_cmds",
]

_RM_NODES = 1 << Node.CTL


def _keys(values: Iterable[int]) -> tuple[int, ...]:
    keys = tuple(sorted(set(values)))
    if not keys:
        raise ValueError("a rule needs at least one value to match")
    if any(not 0 <= k <= 0xFFFFFFFF for k in keys):
        raise ValueError("match values are u32")
    return keys


def rm_alloc_classes(classes: Iterable[int], *, post: bool = False,
                     shadow: bool = False) -> tuple[Rule, ...]:
    """RM_ALLOC of these object classes, as NVOS21 (32 B) and NVOS64 (48 B),
    with their alloc params where vgpud knows the class's (ALLOC_PARAMS):
    the size the driver reads for the class. One pair of rules per size; the
    classes of no known params get a pair without a buffer."""
    keys = _keys(classes)

    def size(k: int) -> int:
        layout = ALLOC_PARAMS.get(k)
        return layout.size if layout else 0

    groups = [(data_size, tuple(group))
              for data_size, group in groupby(sorted(keys, key=size), key=size)]
    return tuple(_rm_alloc_rule(layout, group, data_size, post, shadow)
                 for data_size, group in groups for layout in (NVOS21, NVOS64))


def _rm_alloc_rule(layout: CStruct, keys: tuple[int, ...], data_size: int, post: bool,
                   shadow: bool) -> Rule:
    if not data_size:
        return _bare_alloc_rule(layout, keys, post, shadow)
    return Rule(
        node_mask=_RM_NODES,
        nr=Escape.RM_ALLOC,
        size=layout.size,
        match_off=layout.offsets["hClass"],
        ptr_off=layout.offsets["pAllocParms"],
        data_size=data_size,
        match=keys,
        post=post,
        shadow=shadow,
    )


def rm_alloc_channel_groups(*, post: bool = True) -> tuple[Rule, Rule]:
    """RM_ALLOC of channel groups (KEPLER_CHANNEL_GROUP_A), as NVOS21 and NVOS64.

    The client, the parent device and the new handle are in the ioctl params
    themselves, so no alloc params are copied. ``post`` (the default): the
    scheduler learns the new group from the POST event. Shadow calls: the
    driver creates the group the daemon saw, and the POST event carries the
    driver's results, whatever the caller's threads write meanwhile.
    """
    return _channel_group_rule(NVOS21, post), _channel_group_rule(NVOS64, post)


def _channel_group_rule(layout: CStruct, post: bool) -> Rule:
    return Rule(node_mask=_RM_NODES, nr=Escape.RM_ALLOC, size=layout.size,
                match_off=layout.offsets["hClass"], match=(NvClass.KEPLER_CHANNEL_GROUP_A,),
                post=post, shadow=True)


def rm_alloc_classes_bare(classes: Iterable[int], *, post: bool = False,
                          shadow: bool = False) -> tuple[Rule, Rule]:
    """RM_ALLOC of these classes, as NVOS21 and NVOS64, without their alloc
    params: for a policy that decides on the class, the parent and the new
    handle alone."""
    keys = _keys(classes)
    return (_bare_alloc_rule(NVOS21, keys, post, shadow),
            _bare_alloc_rule(NVOS64, keys, post, shadow))


def _bare_alloc_rule(layout: CStruct, keys: tuple[int, ...], post: bool, shadow: bool) -> Rule:
    if not keys:  # every class
        return Rule(node_mask=_RM_NODES, nr=Escape.RM_ALLOC, size=layout.size, post=post,
                    shadow=shadow)
    return Rule(node_mask=_RM_NODES, nr=Escape.RM_ALLOC, size=layout.size,
                match_off=layout.offsets["hClass"], match=keys, post=post, shadow=shadow)


def rm_alloc_any(*, post: bool = False, shadow: bool = False) -> tuple[Rule, Rule]:
    """Every RM_ALLOC (NVOS21 and NVOS64), whatever its class, without alloc
    params. Put it after the rules that name classes (the first rule that
    matches wins): it selects the calls none of them did, so that a policy
    can refuse the classes it does not know."""
    return (_bare_alloc_rule(NVOS21, (), post, shadow),
            _bare_alloc_rule(NVOS64, (), post, shadow))


def rm_alloc_memory_any(*, post: bool = False, shadow: bool = False) -> Rule:
    """Every RM_ALLOC_MEMORY (NVOS02 + fd, on the GPU node), whatever its
    class; after rm_alloc_memory_classes, as rm_alloc_any."""
    return Rule(node_mask=1 << Node.GPU, nr=Escape.RM_ALLOC_MEMORY, size=NVOS02_WITH_FD.size,
                post=post, shadow=shadow)


def rm_control_cmds(cmds: Iterable[int], *, post: bool = False, shadow: bool = False) -> Rule:
    """RM_CONTROL of these command ids, with their params copied."""
    return Rule(
        node_mask=_RM_NODES,
        nr=Escape.RM_CONTROL,
        size=NVOS54.size,
        match_off=NVOS54.offsets["cmd"],
        ptr_off=NVOS54.offsets["params"],
        len_off=NVOS54.offsets["paramsSize"],
        match=_keys(cmds),
        post=post,
        shadow=shadow,
    )


def rm_control_fb_get_info(*, post: bool = False, shadow: bool = False) -> Filter:
    """RM_CONTROL FB_GET_INFO (v1) and its {index, data} list: the module copies
    the control params (NV2080_CTRL_FB_GET_INFO_PARAMS) and the list its
    fbInfoList points to, fbInfoListSize entries of NV2080_CTRL_FB_INFO, at most
    NV2080_CTRL_FB_INFO_MAX_LIST_SIZE (VGPU_A_DATA2). A filter of one rule, so
    that its nested list names it; add it to the policy's filter."""
    rule = rm_control_cmds([Ctrl.FB_GET_INFO], post=post, shadow=shadow)
    nested = RuleNested(
        rule=0,
        ptr_off=NV2080_CTRL_FB_GET_INFO_PARAMS.offsets["fbInfoList"],
        count_off=NV2080_CTRL_FB_GET_INFO_PARAMS.offsets["fbInfoListSize"],
        elem_size=FB_INFO_ENTRY.size,
        max_count=FB_INFO_MAX_LIST_SIZE,
    )
    return Filter(rules=(rule,), nested=(nested,))


def rm_free(*, post: bool = False, shadow: bool = False) -> Rule:
    """Every RM_FREE (NVOS00)."""
    return Rule(node_mask=_RM_NODES, nr=Escape.RM_FREE, size=NVOS00.size, post=post,
                shadow=shadow)


def rm_dup_object(*, post: bool = False, shadow: bool = False) -> Rule:
    """Every RM_DUP_OBJECT (NVOS55)."""
    return Rule(node_mask=_RM_NODES, nr=Escape.RM_DUP_OBJECT, size=NVOS55.size, post=post,
                shadow=shadow)


def rm_alloc_memory_classes(classes: Iterable[int], *, post: bool = False,
                            shadow: bool = False) -> Rule:
    """RM_ALLOC_MEMORY (NVOS02 + fd, on the GPU node only) of these classes."""
    return Rule(
        node_mask=1 << Node.GPU,
        nr=Escape.RM_ALLOC_MEMORY,
        size=NVOS02_WITH_FD.size,
        match_off=NVOS02_WITH_FD.offsets["hClass"],
        match=_keys(classes),
        post=post,
        shadow=shadow,
    )


def rm_vid_heap(*, post: bool = False, shadow: bool = False) -> Rule:
    """Every RM_VID_HEAP_CONTROL (NVOS32), whatever its function: the policy
    must see the functions it does not know, to refuse them."""
    return Rule(node_mask=_RM_NODES, nr=Escape.RM_VID_HEAP_CONTROL, size=NVOS32.size,
                post=post, shadow=shadow)


def uvm_cmds(cmds: Iterable[int]) -> tuple[Rule, ...]:
    """nvidia-uvm ioctls of these command numbers, whatever their params (none
    are copied): for a policy that decides on the command alone. UVM params
    change size between driver releases; without a size, no shadow either."""
    return tuple(Rule(node_mask=1 << Node.UVM, nr=cmd, size=0) for cmd in _keys(cmds))
