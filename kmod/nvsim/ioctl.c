// SPDX-License-Identifier: GPL-2.0-only
/*
 * nvsim ioctl dispatch, after nvidia_ioctl() and RmIoctl():
 *  - only _IOC_NR and _IOC_SIZE of the command word count;
 *  - each escape has an exact size (RM_ALLOC: one of two, CARD_INFO and
 *    ATTACH_GPUS_TO_FD: a nonzero multiple); a mismatch or an unknown
 *    escape is -EINVAL;
 *  - NV_ESC_IOCTL_XFER_CMD carries {cmd, size, ptr} for the real call,
 *    size at most NV_ABSOLUTE_MAX_IOCTL_SIZE;
 *  - the parameters are copied in once, handled in a kernel buffer and
 *    copied back unless the copy-in faulted (also on -EINVAL, as NVIDIA
 *    does, so a rejected version check returns the driver's string);
 *  - an RM escape that reaches the RM returns 0 and its outcome in the
 *    struct's status field; escapes used on the wrong kind of node
 *    (e.g. RM_ALLOC on nvidiaN) are -EINVAL;
 *  - NVSIM_ESC_SUBMIT_WORK (0xf0) is nvsim's own, on nvidiactl only, and
 *    behaves as an RM escape (exact size, status in params).
 *
 * For latency tests, the parameters delay_nr and delay_us (writable, as
 * root) make every call of one escape (after XFER) sleep that long in the
 * driver, after its handler ran: a known time spent in the driver.
 */
#include <linux/delay.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/ioctl.h>
#include <linux/moduleparam.h>
#include <linux/sched.h>
#include <linux/slab.h>
#include <linux/string.h>
#include <linux/uaccess.h>

#include "nvsim.h"

/* Longest injected delay: one second. */
#define NVSIM_DELAY_MAX_US	USEC_PER_SEC

static int delay_nr = -1;
module_param(delay_nr, int, 0644);
MODULE_PARM_DESC(delay_nr, "escape number whose calls sleep delay_us (-1: none)");

static unsigned int delay_us;
module_param(delay_us, uint, 0644);
MODULE_PARM_DESC(delay_us, "microseconds an escape of delay_nr sleeps (at most 1 s)");

#define NVSIM_SIZE_ARRAY	0x1	/* a nonzero multiple of .size */
#define NVSIM_SIZE_ALLOC	0x2	/* NVOS21 or NVOS64 */

struct nvsim_escape {
	u32 nr;
	u32 size;
	u32 flags;
};

static const struct nvsim_escape nvsim_escapes[] = {
	{ NV_ESC_RM_ALLOC_MEMORY, sizeof(struct nvos02_with_fd), 0 },
	{ NV_ESC_RM_FREE, sizeof(struct nvos00), 0 },
	{ NV_ESC_RM_CONTROL, sizeof(struct nvos54), 0 },
	{ NV_ESC_RM_ALLOC, 0, NVSIM_SIZE_ALLOC },
	{ NV_ESC_RM_DUP_OBJECT, sizeof(struct nvos55), 0 },
	{ NV_ESC_RM_VID_HEAP_CONTROL, sizeof(struct nvos32), 0 },
	{ NV_ESC_RM_MAP_MEMORY, sizeof(struct nvos33_with_fd), 0 },
	{ NV_ESC_RM_UNMAP_MEMORY, sizeof(struct nvos34), 0 },
	{ NV_ESC_CARD_INFO, sizeof(struct nv_card_info), NVSIM_SIZE_ARRAY },
	{ NV_ESC_REGISTER_FD, sizeof(struct nv_register_fd), 0 },
	{ NV_ESC_CHECK_VERSION_STR, sizeof(struct nv_rm_api_version), 0 },
	{ NV_ESC_IOCTL_XFER_CMD, sizeof(struct nv_ioctl_xfer), 0 },
	{ NV_ESC_ATTACH_GPUS_TO_FD, sizeof(u32), NVSIM_SIZE_ARRAY },
	{ NV_ESC_WAIT_OPEN_COMPLETE, sizeof(struct nv_wait_open_complete), 0 },
	{ NVSIM_ESC_SUBMIT_WORK, sizeof(struct nvsim_submit_work), 0 },
};

static bool nvsim_size_ok(u32 nr, u32 size)
{
	unsigned int i;

	for (i = 0; i < ARRAY_SIZE(nvsim_escapes); i++) {
		const struct nvsim_escape *e = &nvsim_escapes[i];

		if (e->nr != nr)
			continue;
		if (e->flags & NVSIM_SIZE_ALLOC)
			return size == sizeof(struct nvos21) ||
			       size == sizeof(struct nvos64);
		if (e->flags & NVSIM_SIZE_ARRAY)
			return size && size % e->size == 0;
		return size == e->size;
	}
	return false;
}

/* Escape 200: one entry per GPU; too small an array is -EINVAL. */
static int nvsim_card_info(struct nv_card_info *ci, u32 size)
{
	size_t n = size / sizeof(*ci);
	unsigned int i;

	memset(ci, 0, size);
	if (n < nvsim_ngpus)
		return -EINVAL;
	for (i = 0; i < nvsim_ngpus; i++) {
		const struct nvsim_gpu *gpu = &nvsim_gpus[i];

		ci[i].valid = 1;
		ci[i].pci_bus = gpu->index + 1;
		ci[i].vendor_id = NVSIM_PCI_VENDOR;
		ci[i].device_id = NVSIM_PCI_DEVICE;
		ci[i].gpu_id = nvsim_gpu_id(gpu);
		ci[i].reg_address = (u64)(0x1000 + gpu->index) << 32;
		ci[i].reg_size = 16 << 20;
		ci[i].fb_address = nvsim_bar1_base(gpu);
		ci[i].fb_size = gpu->capacity;
		ci[i].minor_number = gpu->index;
	}
	return 0;
}

/* Escape 210: as RmPerformVersionCheck(). */
static int nvsim_check_version(struct nv_rm_api_version *p)
{
	static const char ours[] = NVSIM_VERSION_STRING;
	unsigned int i;

	p->reply = NV_RM_API_VERSION_REPLY_RECOGNIZED;
	if (p->cmd == NV_RM_API_VERSION_CMD_QUERY) {
		strscpy(p->version_string, ours, sizeof(p->version_string));
		return 0;
	}
	for (i = 0; i < sizeof(ours); i++) {
		if (p->version_string[i] != ours[i])
			break;
		if (p->cmd == NV_RM_API_VERSION_CMD_RELAXED && ours[i] == '.')
			return 0;
		if (!ours[i])
			return 0;
	}
	strscpy(p->version_string, ours, sizeof(p->version_string));
	return -EINVAL;
}

/*
 * Escape 201: link this file to a control file.  As the real driver: the
 * fd must name a control device file of the driver (nv_get_file_private
 * with ctl: major and minor 255) that is neither this file nor itself
 * linked, and a file links once.  Every refusal is -EINVAL.  The link holds
 * a reference on the control file until this file closes, and reads its
 * private data later (nvsim_owner()).
 */
static int nvsim_register_fd(struct file *file, struct nv_register_fd *p)
{
	struct nvsim_file *nf = file->private_data;
	struct nvsim_file *target;
	struct file *ctl;
	int ret = 0;

	ctl = nvsim_file_get(p->ctl_fd, true, &target);
	if (!ctl)
		return -EINVAL;
	if (target == nf) {
		fput(ctl);
		return -EINVAL;
	}

	mutex_lock(&nvsim_lock);
	if (nf->ctl_file || target->kind != NVSIM_FILE_CTL || target->ctl_file)
		ret = -EINVAL;
	else
		nf->ctl_file = ctl;
	mutex_unlock(&nvsim_lock);

	if (ret)
		fput(ctl);
	return ret;
}

/* Escape 212: the GPU ids this control file will use; once per file. */
static int nvsim_attach_gpus(struct nvsim_file *nf, const u32 *ids, u32 size)
{
	size_t n = size / sizeof(*ids);
	size_t i;
	unsigned int g;
	int ret = 0;

	for (i = 0; i < n; i++) {
		if (!ids[i])
			continue;
		for (g = 0; g < nvsim_ngpus; g++)
			if (ids[i] == nvsim_gpu_id(&nvsim_gpus[g]))
				break;
		if (g == nvsim_ngpus)
			return -EINVAL;
	}
	mutex_lock(&nvsim_lock);
	if (nf->attached)
		ret = -EINVAL;
	nf->attached = true;
	mutex_unlock(&nvsim_lock);
	return ret;
}

static int nvsim_dispatch(struct file *file, u32 nr, void *buf, u32 size)
{
	struct nvsim_file *nf = file->private_data;
	bool ctl = nf->kind == NVSIM_FILE_CTL;

	switch (nr) {
	case NV_ESC_WAIT_OPEN_COMPLETE:
		memset(buf, 0, size);
		return 0;
	case NV_ESC_CARD_INFO:
		return ctl ? nvsim_card_info(buf, size) : -EINVAL;
	case NV_ESC_CHECK_VERSION_STR:
		return ctl ? nvsim_check_version(buf) : -EINVAL;
	case NV_ESC_ATTACH_GPUS_TO_FD:
		return ctl ? nvsim_attach_gpus(nf, buf, size) : -EINVAL;
	case NV_ESC_REGISTER_FD:
		return nvsim_register_fd(file, buf);
	case NV_ESC_RM_ALLOC:
		return ctl ? nvsim_rm_alloc(nf, buf, size) : -EINVAL;
	case NV_ESC_RM_FREE:
		return ctl ? nvsim_rm_free(nf, buf) : -EINVAL;
	case NV_ESC_RM_CONTROL:
		return ctl ? nvsim_rm_control(nf, buf) : -EINVAL;
	case NV_ESC_RM_DUP_OBJECT:
		return ctl ? nvsim_rm_dup_object(nf, buf) : -EINVAL;
	case NV_ESC_RM_VID_HEAP_CONTROL:
		return ctl ? nvsim_rm_vid_heap(nf, buf) : -EINVAL;
	case NV_ESC_RM_MAP_MEMORY:
		return ctl ? nvsim_rm_map_memory(nf, buf) : -EINVAL;
	case NV_ESC_RM_UNMAP_MEMORY:
		return ctl ? nvsim_rm_unmap_memory(nf, buf) : -EINVAL;
	case NVSIM_ESC_SUBMIT_WORK:
		return ctl ? nvsim_submit_work(nf, buf) : -EINVAL;
	case NV_ESC_RM_ALLOC_MEMORY:
		return nf->kind == NVSIM_FILE_GPU ?
			nvsim_rm_alloc_memory(nf, buf) : -EINVAL;
	default:
		return -EINVAL;
	}
}

/*
 * nvidia-uvm: only UVM_INITIALIZE, {u64 flags; u32 rmStatus}.  A second
 * initialize with other flags answers NV_ERR_INVALID_ARGUMENT, as UVM.
 */
static long nvsim_uvm_ioctl(struct nvsim_file *nf, unsigned int cmd,
			    void __user *uptr)
{
	struct uvm_initialize_params p;

	if (cmd != UVM_INITIALIZE)
		return -EINVAL;
	if (copy_from_user(&p, uptr, sizeof(p)))
		return -EFAULT;
	mutex_lock(&nvsim_lock);
	if (nf->uvm_initialized && nf->uvm_flags != p.flags) {
		p.rm_status = NV_ERR_INVALID_ARGUMENT;
	} else {
		nf->uvm_initialized = true;
		nf->uvm_flags = p.flags;
		p.rm_status = NV_OK;
	}
	mutex_unlock(&nvsim_lock);
	if (copy_to_user(uptr, &p, sizeof(p)))
		return -EFAULT;
	return 0;
}

static void nvsim_delay(u32 nr)
{
	unsigned long us = min_t(unsigned long, READ_ONCE(delay_us),
				 NVSIM_DELAY_MAX_US);

	/* An hrtimer sleep with 1/16 of slack (fsleep's may double it). */
	if (us && READ_ONCE(delay_nr) == (int)nr)
		usleep_range(us, us + us / 16);
}

long nvsim_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct nvsim_file *nf = file->private_data;
	void __user *uptr = (void __user *)arg;
	u32 nr = _IOC_NR(cmd);
	u32 size = _IOC_SIZE(cmd);
	void *buf;
	int ret;

	nvsim_count_rm_call();
	if (nf->kind == NVSIM_FILE_UVM)
		return nvsim_uvm_ioctl(nf, cmd, uptr);

	if (!nvsim_size_ok(nr, size))
		return -EINVAL;

	if (nr == NV_ESC_IOCTL_XFER_CMD) {
		struct nv_ioctl_xfer xfer;

		if (copy_from_user(&xfer, uptr, sizeof(xfer)))
			return -EFAULT;
		nr = xfer.cmd;
		size = xfer.size;
		uptr = u64_to_user_ptr(xfer.ptr);
		if (size > NV_ABSOLUTE_MAX_IOCTL_SIZE)
			return -EINVAL;
		/* Each handler checks its size; nesting XFER is unknown. */
		if (nr == NV_ESC_IOCTL_XFER_CMD || !nvsim_size_ok(nr, size))
			return -EINVAL;
	}

	buf = kmalloc(size, GFP_KERNEL);
	if (!buf)
		return -ENOMEM;
	if (copy_from_user(buf, uptr, size)) {
		kfree(buf);
		return -EFAULT;
	}

	ret = nvsim_dispatch(file, nr, buf, size);
	nvsim_delay(nr);

	if (copy_to_user(uptr, buf, size))
		ret = -EFAULT;
	kfree(buf);
	return ret;
}
