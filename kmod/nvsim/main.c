// SPDX-License-Identifier: GPL-2.0-only
/*
 * nvsim: a simulated NVIDIA driver for tests.
 *
 * Nodes under /dev/nvsim/: nvidiactl (minor 255), nvidia0..N-1 (minors
 * 0..N-1) and nvidia-uvm (minor 254), on a char major of our own (a cdev,
 * not misc: a misc open that opens another misc device deadlocks on
 * misc_mtx).  This file holds the module and file plumbing.
 */
#include <linux/atomic.h>
#include <linux/build_bug.h>
#include <linux/cdev.h>
#include <linux/device.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/kdev_t.h>
#include <linux/module.h>
#include <linux/sched.h>
#include <linux/slab.h>
#include <linux/sysfs.h>
#include <linux/stddef.h>

#include "compat.h"
#include "nvsim.h"

static unsigned int gpus = 2;
module_param(gpus, uint, 0444);
MODULE_PARM_DESC(gpus, "Number of simulated GPUs (1-8, default 2)");

static unsigned int mem_mib = 4096;
module_param(mem_mib, uint, 0444);
MODULE_PARM_DESC(mem_mib, "Memory per GPU in MiB (default 4096)");

/* 0600 models a host whose real nodes are root-only (udev/, systemd/). */
static unsigned int node_mode = 0666;
module_param(node_mode, uint, 0444);
MODULE_PARM_DESC(node_mode, "Mode of the /dev/nvsim nodes (default 0666)");

/*
 * Calls that reached nvsim: every ioctl on any of its files, counted before
 * any check (read-only parameter rm_calls), so a test can prove that an
 * intercepted call never got here.
 */
static atomic64_t nvsim_rm_calls = ATOMIC64_INIT(0);

void nvsim_count_rm_call(void)
{
	atomic64_inc(&nvsim_rm_calls);
}

static int nvsim_rm_calls_get(char *buf, const struct kernel_param *kp)
{
	return sysfs_emit(buf, "%lld\n", (long long)atomic64_read(&nvsim_rm_calls));
}

static const struct kernel_param_ops nvsim_rm_calls_ops = {
	.get = nvsim_rm_calls_get,
};

module_param_cb(rm_calls, &nvsim_rm_calls_ops, NULL, 0444);
MODULE_PARM_DESC(rm_calls, "ioctl calls received, all files (read-only)");

/*
 * Successful opens of any nvsim file (read-only parameter opens), so a test
 * can prove that an opener refused above the driver never reached it.
 */
static atomic64_t nvsim_opens = ATOMIC64_INIT(0);

static int nvsim_opens_get(char *buf, const struct kernel_param *kp)
{
	return sysfs_emit(buf, "%lld\n", (long long)atomic64_read(&nvsim_opens));
}

static const struct kernel_param_ops nvsim_opens_ops = {
	.get = nvsim_opens_get,
};

module_param_cb(opens, &nvsim_opens_ops, NULL, 0444);
MODULE_PARM_DESC(opens, "files opened, all nodes (read-only)");

struct nvsim_gpu nvsim_gpus[NVSIM_MAX_GPUS];
unsigned int nvsim_ngpus;

static dev_t nvsim_devt;
static struct cdev nvsim_cdev;
static struct class *nvsim_class;

static int nvsim_open(struct inode *inode, struct file *file);
static int nvsim_release(struct inode *inode, struct file *file);

static const struct file_operations nvsim_fops = {
	.owner = THIS_MODULE,
	.open = nvsim_open,
	.release = nvsim_release,
	.unlocked_ioctl = nvsim_ioctl,
	.mmap = nvsim_mmap,
	.llseek = noop_llseek,
};

/*
 * The driver file a descriptor of the caller names, as NVIDIA's
 * nv_get_file_private(): fget(@fd), then the file's inode must be a
 * character device of nvsim's major with the control minor (@ctl) or a GPU
 * minor, and its private data is then the per-file state. Like NVIDIA's,
 * this trusts the device number, not the file operations: a file of
 * another module that carries our device number is taken as ours.
 *
 * Return: the file, one reference held (fput() it), with *@nfp set; or
 * NULL when @fd names no such file.
 */
struct file *nvsim_file_get(int fd, bool ctl, struct nvsim_file **nfp)
{
	struct inode *inode;
	struct file *f;
	dev_t rdev;

	f = fget(fd);
	if (!f)
		return NULL;
	inode = file_inode(f);
	rdev = READ_ONCE(inode->i_rdev);
	if (!S_ISCHR(inode->i_mode) || MAJOR(rdev) != MAJOR(nvsim_devt) ||
	    (ctl ? MINOR(rdev) != NVSIM_MINOR_CTL :
		   MINOR(rdev) >= nvsim_ngpus) ||
	    !f->private_data) {
		fput(f);
		return NULL;
	}
	*nfp = f->private_data;
	return f;
}

static int nvsim_open(struct inode *inode, struct file *file)
{
	unsigned int minor = iminor(inode);
	struct nvsim_file *nf;

	if (minor >= nvsim_ngpus && minor != NVSIM_MINOR_CTL &&
	    minor != NVSIM_MINOR_UVM)
		return -ENODEV;

	nf = kzalloc(sizeof(*nf), GFP_KERNEL);
	if (!nf)
		return -ENOMEM;
	INIT_LIST_HEAD(&nf->clients);
	nf->tgid = task_tgid_nr(current);
	if (minor == NVSIM_MINOR_CTL) {
		nf->kind = NVSIM_FILE_CTL;
	} else if (minor == NVSIM_MINOR_UVM) {
		nf->kind = NVSIM_FILE_UVM;
	} else {
		nf->kind = NVSIM_FILE_GPU;
		nf->gpu = &nvsim_gpus[minor];
	}
	file->private_data = nf;
	atomic64_inc(&nvsim_opens);
	return 0;
}

static int nvsim_release(struct inode *inode, struct file *file)
{
	struct nvsim_file *nf = file->private_data;
	struct nvsim_mapctx *ctx;
	struct file *ctl;

	mutex_lock(&nvsim_lock);
	nvsim_file_free_clients(nf);
	ctx = nf->mapctx;
	nf->mapctx = NULL;
	ctl = nf->ctl_file;
	nf->ctl_file = NULL;
	mutex_unlock(&nvsim_lock);

	if (ctx)
		nvsim_mapctx_free(ctx);
	if (ctl)
		fput(ctl);
	kfree(nf);
	return 0;
}

static char *nvsim_devnode(NVSIM_DEVNODE_CONST struct device *dev, umode_t *mode)
{
	if (mode)
		*mode = node_mode;
	return kasprintf(GFP_KERNEL, "nvsim/%s", dev_name(dev));
}

/* Pins the NVIDIA layouts nvsim decodes (x86-64 sizes and offsets). */
static void __init nvsim_abi_check(void)
{
	BUILD_BUG_ON(sizeof(struct nvos00) != 16);
	BUILD_BUG_ON(sizeof(struct nvos21) != 32);
	BUILD_BUG_ON(offsetof(struct nvos21, params_size) != 24);
	BUILD_BUG_ON(sizeof(struct nvos64) != 48);
	BUILD_BUG_ON(offsetof(struct nvos64, params_size) != 32);
	BUILD_BUG_ON(offsetof(struct nvos64, status) != 40);
	BUILD_BUG_ON(sizeof(struct nvos54) != 32);
	BUILD_BUG_ON(sizeof(struct nvos55) != 28);
	BUILD_BUG_ON(offsetof(struct nvos55, h_object_src) != 16);
	BUILD_BUG_ON(offsetof(struct nvos55, status) != 24);
	BUILD_BUG_ON(offsetof(struct nvos54, status) != 28);
	BUILD_BUG_ON(sizeof(struct nvos33_with_fd) != 56);
	BUILD_BUG_ON(offsetof(struct nvos33_with_fd, p_linear_address) != 32);
	BUILD_BUG_ON(offsetof(struct nvos33_with_fd, fd) != 48);
	BUILD_BUG_ON(sizeof(struct nvos34) != 32);
	BUILD_BUG_ON(sizeof(struct nva06c_preempt_params) != 8);
	BUILD_BUG_ON(offsetof(struct nva06c_preempt_params, timeout_us) != 4);
	BUILD_BUG_ON(offsetof(struct nvos34, status) != 24);
	BUILD_BUG_ON(sizeof(struct nvos02_with_fd) != 56);
	BUILD_BUG_ON(offsetof(struct nvos02_with_fd, limit) != 32);
	BUILD_BUG_ON(offsetof(struct nvos02_with_fd, fd) != 48);
	BUILD_BUG_ON(sizeof(struct nvos32) != 184);
	BUILD_BUG_ON(offsetof(struct nvos32, status) != 20);
	BUILD_BUG_ON(offsetof(struct nvos32, data) != 40);
	BUILD_BUG_ON(offsetof(struct nvos32, data.alloc_size.size) != 88);
	BUILD_BUG_ON(offsetof(struct nvos32, data.alloc_size.offset) != 104);
	BUILD_BUG_ON(offsetof(struct nvos32, data.alloc_size.numa_node) != 152);
	BUILD_BUG_ON(offsetof(struct nvos32, data.info.size) != 56);
	BUILD_BUG_ON(offsetof(struct nvos32, data.alloc_tiled.height) != 56);
	BUILD_BUG_ON(offsetof(struct nvos32, data.alloc_tiled.pitch) != 60);
	BUILD_BUG_ON(offsetof(struct nvos32, data.alloc_tiled.size) != 88);
	BUILD_BUG_ON(offsetof(struct nvos32, data.alloc_tiled.range_begin) != 128);
	BUILD_BUG_ON(offsetof(struct nvos32, data.alloc_tiled.numa_node) != 152);
	BUILD_BUG_ON(offsetof(struct nvos32, data.alloc_range.size) != 80);
	BUILD_BUG_ON(offsetof(struct nvos32, data.alloc_range.limit) != 104);
	BUILD_BUG_ON(offsetof(struct nvos32, data.alloc_range.range_begin) != 112);
	BUILD_BUG_ON(offsetof(struct nvos32, data.alloc_range.address) != 128);
	BUILD_BUG_ON(offsetof(struct nvos32, data.alloc_range.numa_node) != 144);
	BUILD_BUG_ON(sizeof(struct nv_card_info) != 72);
	BUILD_BUG_ON(offsetof(struct nv_card_info, fb_size) != 48);
	BUILD_BUG_ON(offsetof(struct nv_card_info, minor_number) != 56);
	BUILD_BUG_ON(sizeof(struct nv_register_fd) != 4);
	BUILD_BUG_ON(sizeof(struct nv_rm_api_version) != 72);
	BUILD_BUG_ON(sizeof(struct nv_ioctl_xfer) != 16);
	BUILD_BUG_ON(sizeof(struct nv_wait_open_complete) != 8);
	BUILD_BUG_ON(sizeof(struct nv0080_alloc_params) != 56);
	BUILD_BUG_ON(offsetof(struct nv0080_alloc_params, va_mode) != 48);
	BUILD_BUG_ON(sizeof(struct nv2080_alloc_params) != 4);
	BUILD_BUG_ON(sizeof(struct nv_memory_allocation_params) != 128);
	BUILD_BUG_ON(offsetof(struct nv_memory_allocation_params, size) != 64);
	BUILD_BUG_ON(offsetof(struct nv_memory_allocation_params, h_va_space) != 108);
	BUILD_BUG_ON(offsetof(struct nv_memory_allocation_params, numa_node) != 120);
	BUILD_BUG_ON(sizeof(struct nv_vaspace_allocation_params) != 56);
	BUILD_BUG_ON(sizeof(struct nv_channel_group_allocation_params) != 20);
	BUILD_BUG_ON(sizeof(struct nv2080_fb_get_info_params) != 16);
	BUILD_BUG_ON(sizeof(struct nv2080_fb_get_info_v2_params) != 1028);
	BUILD_BUG_ON(sizeof(struct nva06c_gpfifo_schedule_params) != 3);
	BUILD_BUG_ON(sizeof(struct nva06c_timeslice_params) != 8);
	BUILD_BUG_ON(sizeof(struct nva06c_interleave_level_params) != 4);
	BUILD_BUG_ON(sizeof(struct uvm_initialize_params) != 16);
	BUILD_BUG_ON(sizeof(struct nvsim_submit_work) != 24);
	BUILD_BUG_ON(offsetof(struct nvsim_submit_work, work_ns) != 8);
	BUILD_BUG_ON(offsetof(struct nvsim_submit_work, status) != 16);
	BUILD_BUG_ON(sizeof(struct nvsim_work_stats_params) != 24);
	BUILD_BUG_ON(offsetof(struct nvsim_work_stats_params, b_enabled) != 16);
}

static int __init nvsim_create_nodes(void)
{
	struct device *dev;
	unsigned int i;

	dev = device_create(nvsim_class, NULL, MKDEV(MAJOR(nvsim_devt), NVSIM_MINOR_CTL),
			    NULL, "nvidiactl");
	if (IS_ERR(dev))
		return PTR_ERR(dev);
	dev = device_create(nvsim_class, NULL, MKDEV(MAJOR(nvsim_devt), NVSIM_MINOR_UVM),
			    NULL, "nvidia-uvm");
	if (IS_ERR(dev))
		return PTR_ERR(dev);
	for (i = 0; i < nvsim_ngpus; i++) {
		dev = device_create(nvsim_class, NULL, MKDEV(MAJOR(nvsim_devt), i),
				    NULL, "nvidia%u", i);
		if (IS_ERR(dev))
			return PTR_ERR(dev);
	}
	return 0;
}

/* Removes whichever nodes exist; device_destroy ignores absent ones. */
static void nvsim_destroy_nodes(void)
{
	unsigned int i;

	for (i = 0; i < nvsim_ngpus; i++)
		device_destroy(nvsim_class, MKDEV(MAJOR(nvsim_devt), i));
	device_destroy(nvsim_class, MKDEV(MAJOR(nvsim_devt), NVSIM_MINOR_UVM));
	device_destroy(nvsim_class, MKDEV(MAJOR(nvsim_devt), NVSIM_MINOR_CTL));
}

static int __init nvsim_init(void)
{
	unsigned int i;
	int ret;

	nvsim_abi_check();

	if (gpus < 1 || gpus > NVSIM_MAX_GPUS || mem_mib < 1 ||
	    mem_mib > (1u << 20) || node_mode > 0777) {
		pr_err("nvsim: gpus must be 1-%d, mem_mib 1-%u, node_mode 0-0777\n",
		       NVSIM_MAX_GPUS, 1u << 20);
		return -EINVAL;
	}
	nvsim_ngpus = gpus;
	for (i = 0; i < nvsim_ngpus; i++) {
		nvsim_gpus[i].index = i;
		nvsim_gpus[i].capacity = (u64)mem_mib << 20;
	}

	ret = nvsim_store_init();
	if (ret)
		return ret;

	ret = nvsim_engine_init();
	if (ret)
		goto err_store;

	ret = alloc_chrdev_region(&nvsim_devt, 0, NVSIM_MINORS, "nvsim");
	if (ret)
		goto err_engine;

	cdev_init(&nvsim_cdev, &nvsim_fops);
	nvsim_cdev.owner = THIS_MODULE;
	ret = cdev_add(&nvsim_cdev, nvsim_devt, NVSIM_MINORS);
	if (ret)
		goto err_region;

	nvsim_class = nvsim_class_create("nvsim");
	if (IS_ERR(nvsim_class)) {
		ret = PTR_ERR(nvsim_class);
		goto err_cdev;
	}
	nvsim_class->devnode = nvsim_devnode;

	ret = nvsim_create_nodes();
	if (ret)
		goto err_nodes;

	pr_info("nvsim: %u GPUs of %u MiB, major %d\n", nvsim_ngpus, mem_mib,
		MAJOR(nvsim_devt));
	return 0;

err_nodes:
	nvsim_destroy_nodes();
	class_destroy(nvsim_class);
err_cdev:
	cdev_del(&nvsim_cdev);
err_region:
	unregister_chrdev_region(nvsim_devt, NVSIM_MINORS);
err_engine:
	nvsim_engine_exit();
err_store:
	nvsim_store_exit();
	return ret;
}

static void __exit nvsim_exit(void)
{
	nvsim_destroy_nodes();
	class_destroy(nvsim_class);
	cdev_del(&nvsim_cdev);
	unregister_chrdev_region(nvsim_devt, NVSIM_MINORS);
	nvsim_engine_exit();
	nvsim_store_exit();
}

module_init(nvsim_init);
module_exit(nvsim_exit);

MODULE_DESCRIPTION("Simulated NVIDIA driver for vgpud tests");
MODULE_LICENSE("GPL");
