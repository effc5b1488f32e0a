// SPDX-License-Identifier: GPL-2.0
/*
 * vgpu: emulated NVIDIA device files for the vgpud GPU-sharing service.
 * Module parameters, counters, and init/exit in mirrored order.
 */
#include <linux/build_bug.h>
#include <net/genetlink.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/stddef.h>

#include "vgpu.h"

#define CREATE_TRACE_POINTS
#include "trace.h"

char *vgpu_backing_dir = "/dev";
module_param_named(backing_dir, vgpu_backing_dir, charp, 0444);
MODULE_PARM_DESC(backing_dir, "directory of the backing driver's nodes (default /dev)");

char *vgpu_backing_driver = "nvidia";
module_param_named(backing_driver, vgpu_backing_driver, charp, 0444);
MODULE_PARM_DESC(backing_driver, "module that must own nvidiactl and nvidiaN (default nvidia)");

char *vgpu_backing_uvm_driver = "nvidia_uvm";
module_param_named(backing_uvm_driver, vgpu_backing_uvm_driver, charp, 0444);
MODULE_PARM_DESC(backing_uvm_driver, "module that must own nvidia-uvm (default nvidia_uvm)");

unsigned int vgpu_upcall_timeout_ms = 5000;
module_param_named(upcall_timeout_ms, vgpu_upcall_timeout_ms, uint, 0644);
MODULE_PARM_DESC(upcall_timeout_ms, "how long a call waits for the daemon's verdict (ms, default 5000)");

bool vgpu_fail_open;
module_param_named(fail_open, vgpu_fail_open, bool, 0644);
MODULE_PARM_DESC(fail_open, "forward calls the daemon cannot decide (default: refuse them)");

/* Upcall slots (upcall.c): a bound per context, per opener, in all. */
static int vgpu_param_set_slots(const char *val, const struct kernel_param *kp,
				unsigned int max)
{
	unsigned int n;
	int err;

	err = kstrtouint(val, 0, &n);
	if (err)
		return err;
	if (n < 1 || n > max)
		return -EINVAL;
	*(unsigned int *)kp->arg = n;
	return 0;
}

static int vgpu_param_set_per_ctx(const char *val, const struct kernel_param *kp)
{
	return vgpu_param_set_slots(val, kp, 64);
}

static int vgpu_param_set_per_opener(const char *val,
				     const struct kernel_param *kp)
{
	return vgpu_param_set_slots(val, kp, 1024);
}

static int vgpu_param_set_max(const char *val, const struct kernel_param *kp)
{
	return vgpu_param_set_slots(val, kp, 4096);
}

static const struct kernel_param_ops vgpu_per_ctx_ops = {
	.set = vgpu_param_set_per_ctx,
	.get = param_get_uint,
};

static const struct kernel_param_ops vgpu_per_opener_ops = {
	.set = vgpu_param_set_per_opener,
	.get = param_get_uint,
};

static const struct kernel_param_ops vgpu_max_ops = {
	.set = vgpu_param_set_max,
	.get = param_get_uint,
};

unsigned int vgpu_upcalls_per_ctx = 4;
module_param_cb(upcalls_per_ctx, &vgpu_per_ctx_ops, &vgpu_upcalls_per_ctx, 0444);
MODULE_PARM_DESC(upcalls_per_ctx, "upcalls in flight per open file, 1..64 (default 4)");

unsigned int vgpu_upcalls_per_opener = 4;
module_param_cb(upcalls_per_opener, &vgpu_per_opener_ops, &vgpu_upcalls_per_opener, 0444);
MODULE_PARM_DESC(upcalls_per_opener, "upcalls in flight per opener (uid and cgroup), 1..1024 (default 4)");

unsigned int vgpu_upcalls_max = 64;
module_param_cb(upcalls_max, &vgpu_max_ops, &vgpu_upcalls_max, 0444);
MODULE_PARM_DESC(upcalls_max, "upcalls in flight in all, 1..4096 (default 64)");

DEFINE_PER_CPU(struct vgpu_counters, vgpu_counters);
DEFINE_PER_CPU(struct vgpu_counters4, vgpu_counters4);

/* The uapi layouts, as the daemon's tests pin them too. */
static void __init vgpu_check_abi(void)
{
	BUILD_BUG_ON(sizeof(struct vgpu_rule) != 160);
	BUILD_BUG_ON(offsetof(struct vgpu_rule, match_off) != 12);
	BUILD_BUG_ON(offsetof(struct vgpu_rule, flags) != 28);
	BUILD_BUG_ON(offsetof(struct vgpu_rule, match) != 32);
	BUILD_BUG_ON(sizeof(struct vgpu_upcall) != 80);
	BUILD_BUG_ON(offsetof(struct vgpu_upcall, kind) != 24);
	BUILD_BUG_ON(offsetof(struct vgpu_upcall, flags) != 44);
	BUILD_BUG_ON(offsetof(struct vgpu_upcall, caller_tgid) != 68);
	BUILD_BUG_ON(offsetof(struct vgpu_upcall, ret) != 72);
	BUILD_BUG_ON(offsetof(struct vgpu_upcall, reserved) != 76);
	BUILD_BUG_ON(sizeof(struct vgpu_verdict) != 32);
	BUILD_BUG_ON(offsetof(struct vgpu_verdict, action) != 8);
	BUILD_BUG_ON(offsetof(struct vgpu_verdict, status_off) != 20);
	BUILD_BUG_ON(offsetof(struct vgpu_verdict, flags) != 24);
	BUILD_BUG_ON(offsetof(struct vgpu_verdict, reserved) != 28);
	BUILD_BUG_ON(sizeof(struct vgpu_mmap_params) != 24);
	BUILD_BUG_ON(offsetof(struct vgpu_mmap_params, prot) != 16);
	BUILD_BUG_ON(sizeof(struct vgpu_event) != 32);
	BUILD_BUG_ON(offsetof(struct vgpu_event, kind) != 16);
	BUILD_BUG_ON(offsetof(struct vgpu_event, ret) != 24);
	BUILD_BUG_ON(sizeof(struct vgpu_stats) != 120);
	BUILD_BUG_ON(sizeof(struct vgpu_context) != 40);
	BUILD_BUG_ON(sizeof(struct vgpu_sched) != 24);
	BUILD_BUG_ON(offsetof(struct vgpu_sched, enable) != 16);
	BUILD_BUG_ON(offsetof(struct vgpu_sched, arg) != 20);
	BUILD_BUG_ON(sizeof(struct vgpu_sched_result) != 8);
	BUILD_BUG_ON(offsetof(struct vgpu_stats, contexts) != 8);
	BUILD_BUG_ON(offsetof(struct vgpu_stats, mmaps) != 112);
	BUILD_BUG_ON(sizeof(struct vgpu_opener) != 16);
	BUILD_BUG_ON(sizeof(struct vgpu_rule_nested) != 24);
	BUILD_BUG_ON(offsetof(struct vgpu_rule_nested, max_count) != 16);
	BUILD_BUG_ON(sizeof(struct vgpu_obj_op) != 24);
	BUILD_BUG_ON(offsetof(struct vgpu_obj_op, op) != 20);
	BUILD_BUG_ON(sizeof(struct vgpu_obj_result) != 16);
	BUILD_BUG_ON(offsetof(struct vgpu_obj_result, value) != 8);
	BUILD_BUG_ON(sizeof(struct vgpu_stats4) != 64);
	/* The NVIDIA layouts the module reads or writes (nvidia/nv_ioctl.h). */
	BUILD_BUG_ON(sizeof(struct nv_ioctl_xfer) != 16);
	BUILD_BUG_ON(sizeof(struct nv_register_fd) != 4);
	BUILD_BUG_ON(offsetof(struct nvos33_with_fd, fd) != 48);
	BUILD_BUG_ON(sizeof(struct nvos33_with_fd) != 56);
	BUILD_BUG_ON(offsetof(struct nvos02_with_fd, fd) != 48);
	BUILD_BUG_ON(sizeof(struct nvos02_with_fd) != 56);
	BUILD_BUG_ON(sizeof(struct nvos21) != 32);
	BUILD_BUG_ON(sizeof(struct nvos64) != 48);
	BUILD_BUG_ON(VGPU_NODE_UVM >= VGPU_NODE_KINDS);
}

/*
 * Four steps, undone in reverse order by the error path and by exit alike:
 * the filter (the fast path's bitmap), the generic netlink family (the
 * daemon's way in), the proxies' filesystem (fdxlate.c), the emulated
 * device files (the tenants' way in).
 */
static int __init vgpu_init(void)
{
	int err;

	vgpu_check_abi();
	vgpu_filter_init();
	err = vgpu_genl_init();
	if (err)
		goto err_filter;
	err = vgpu_fdx_init();
	if (err)
		goto err_genl;
	err = vgpu_chardev_init();
	if (err)
		goto err_fdx;
	pr_info("vgpu: loaded, backing %s (%s, %s), protocol %u\n",
		vgpu_backing_dir, vgpu_backing_driver, vgpu_backing_uvm_driver,
		VGPU_PROTO_VERSION);
	return 0;

err_fdx:
	vgpu_fdx_exit();
err_genl:
	vgpu_genl_exit();
err_filter:
	vgpu_filter_exit();
	return err;
}

static void __exit vgpu_exit(void)
{
	vgpu_chardev_exit();
	vgpu_fdx_exit();
	vgpu_genl_exit();
	vgpu_filter_exit();
}

module_init(vgpu_init);
module_exit(vgpu_exit);

MODULE_LICENSE("GPL");
MODULE_AUTHOR("vgpud project");
MODULE_DESCRIPTION("Emulated NVIDIA device files with daemon upcalls");
/* As kmod/dkms.conf's PACKAGE_VERSION. */
MODULE_VERSION("0.1.0");
/* Resolving the family "vgpu" (CTRL_CMD_GETFAMILY) loads the module. */
MODULE_ALIAS_GENL_FAMILY(VGPU_GENL_NAME);
