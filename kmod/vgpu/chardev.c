// SPDX-License-Identifier: GPL-2.0
/*
 * The emulated device files /dev/vgpu/{nvidiactl,nvidiaN,nvidia-uvm}: one
 * char major of our own, minors as NVIDIA's (GPU N = N, ctl = 255, uvm =
 * 254). Every open opens the matching backing driver file; calls are
 * forwarded to it, and the calls the daemon's filter selects are first
 * upcalled for a verdict.
 *
 * The backing nodes are resolved once, at load, in the loader's namespace,
 * and opened with the loader's credentials: what a caller's mount namespace
 * binds at /dev/nvidia* and who the caller is never change which file backs
 * an emulated one. A backing file must be a character device of the
 * expected driver module (backing_driver, backing_uvm_driver), never one of
 * ours.
 *
 * vgpu_ioctl() chooses a call's path: a plain forward, a forward of a call
 * with a wrapper or fd argument (vgpu_forward()), or the slow path of a call
 * some rule may select (slowpath.c, vgpu_ioctl_slow()).
 */
#include <linux/cdev.h>
#include <linux/cgroup.h>
#include <linux/cred.h>
#include <linux/device.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/mm.h>
#include <linux/mman.h>
#include <linux/namei.h>
#include <linux/poll.h>
#include <linux/sched.h>
#include <linux/slab.h>
#include <linux/uaccess.h>

#include "vgpu.h"
#include "compat.h"
#include "trace.h"

static dev_t vgpu_devt;
static struct cdev vgpu_cdev;
static struct class *vgpu_class;
/* The loader's credentials, for every backing open; held until unload. */
static const struct cred *vgpu_backing_cred;
/* Indexed by minor; filled before cdev_add(), read-only until unload. */
static struct vgpu_node_dev *vgpu_nodes[VGPU_MINORS];
static atomic64_t vgpu_ctx_ids = ATOMIC64_INIT(0);

/*
 * The driver may have read something else than the shadow (it was unmapped
 * during the call): the context is revoked, every later call fails.
 */
static void vgpu_revoke(struct vgpu_ctx *ctx, u32 reason)
{
	struct vgpu_event ev = {
		.ctx_id = ctx->id,
		.kind = VGPU_EVENT_REVOKED,
		.nr = reason,
	};

	if (READ_ONCE(ctx->revoked))
		return;
	WRITE_ONCE(ctx->revoked, true);
	vgpu_count4(revoked);
	pr_warn_ratelimited("vgpu: context %llu revoked: its shadow was unmapped during a call\n",
			    ctx->id);
	vgpu_event(&ev, NULL, 0, NULL, 0);
}

/*
 * Calls the driver, on @sh when the call's blocks are shadowed (NULL: the
 * caller's memory). An IOCTL_XFER_CMD call without a shadow gets a copy
 * of the wrapper the module read (shadow.c): were the driver to read the
 * caller's again, a thread rewriting it in between would take a call past
 * the filter.
 */
long vgpu_forward(struct vgpu_ctx *ctx, const struct vgpu_call *c,
		  struct vgpu_shadow *sh)
{
	struct file *b = ctx->backing;
	struct vgpu_shadow own = {};
	unsigned long arg = c->arg;
	struct vgpu_fdx x;
	long ret;

	if (!b->f_op->unlocked_ioctl)
		return -ENOTTY;
	if (c->xfer) {
		ret = vgpu_shadow_map_wrapper(&own, ctx, c->xfer);
		if (ret)
			return ret;
		arg = own.arg;
		sh = &own;
	}
	ret = vgpu_fdx_prepare(&x, c->node, c->nr, c->size, c->params,
			       sh ? sh->kparams : NULL);
	if (ret)
		goto out;
	vgpu_shadow_enter(sh);
	ret = b->f_op->unlocked_ioctl(b, c->cmd, arg);
	if (!vgpu_shadow_leave(sh)) {
		vgpu_revoke(ctx, VGPU_REVOKE_SHADOW);
		ret = -EIO;
	}
	vgpu_fdx_finish(&x);
out:
	vgpu_shadow_unmap(&own);
	return ret;
}

/* Starts @m as an upcall of @kind for @ctx, from the current thread. */
void vgpu_msg_init(struct vgpu_upcall_msg *m, struct vgpu_ctx *ctx, u32 kind)
{
	memset(m, 0, sizeof(*m));
	m->ctx = ctx;
	m->hdr.ctx_id = ctx->id;
	m->hdr.cgroup_id = ctx->cgroup_id;
	m->hdr.kind = kind;
	m->hdr.node = ctx->node->kind;
	m->hdr.minor = ctx->node->index;
	m->hdr.pid = ctx->pid;
	m->hdr.tgid = ctx->tgid;
	m->hdr.uid = ctx->uid;
	m->hdr.gid = ctx->gid;
	m->hdr.caller_pid = task_pid_nr(current);
	m->hdr.caller_tgid = task_tgid_nr(current);
}

/* A call that no rule, wrapper or fd argument concerns: forward it as is. */
static long vgpu_ioctl_plain(struct vgpu_ctx *ctx, unsigned int cmd, u32 nr,
			     unsigned long arg)
{
	struct file *b = ctx->backing;
	long ret = -ENOTTY;

	trace_vgpu_ioctl_enter(ctx->id, cmd, nr);
	if (b->f_op->unlocked_ioctl)
		ret = b->f_op->unlocked_ioctl(b, cmd, arg);
	trace_vgpu_ioctl_exit(ctx->id, nr, ret, false, 0);
	return ret;
}

static long vgpu_ioctl(struct file *file, unsigned int cmd, unsigned long arg)
{
	struct vgpu_ctx *ctx = file->private_data;
	u32 node = ctx->node->kind;
	struct vgpu_call c = {
		.cmd = cmd,
		.node = node,
		.params = (void __user *)arg,
		.arg = arg,
	};
	struct nv_ioctl_xfer xfer;
	u32 copy_size, key = 0;
	bool slow = false;
	long ret;

	vgpu_count(ioctls);
	if (READ_ONCE(ctx->revoked))
		return -EIO;
	if (node == VGPU_NODE_UVM) {
		c.nr = cmd;
	} else {
		c.nr = _IOC_NR(cmd);
		c.size = _IOC_SIZE(cmd);
	}
	if (!vgpu_nr_hot(node, c.nr))
		return vgpu_ioctl_plain(ctx, cmd, c.nr, arg);
	if (c.node != VGPU_NODE_UVM && c.nr == NV_ESC_IOCTL_XFER_CMD &&
	    c.size == sizeof(xfer)) {
		if (copy_from_user(&xfer, c.params, sizeof(xfer)))
			return -EFAULT;
		c.xfer = &xfer;
		/*
		 * Oversized: left to the driver, which refuses it. The driver
		 * takes the wrapper's cmd as the escape number, whole: a value
		 * with bits above the low 8 selects no rule and reaches the
		 * driver as it was read, to be refused there.
		 */
		if (xfer.size <= VGPU_PARAMS_MAX) {
			c.nr = xfer.cmd;
			c.size = xfer.size;
			c.params = u64_to_user_ptr(xfer.ptr);
			c.flags = VGPU_UPCALL_F_XFER;
		}
	}

	trace_vgpu_ioctl_enter(ctx->id, cmd, c.nr);
	copy_size = c.size;
	if (vgpu_filter_candidates(c.node, c.nr, &copy_size)) {
		slow = true;
		ret = vgpu_ioctl_slow(ctx, &c, copy_size, &key);
	} else {
		ret = vgpu_forward(ctx, &c, NULL);
	}
	trace_vgpu_ioctl_exit(ctx->id, c.nr, ret, slow, key);
	return ret;
}

static int vgpu_open_upcall(struct vgpu_ctx *ctx)
{
	struct vgpu_opener opener = {
		.start_boottime_ns = ctx->start_boottime,
	};
	struct vgpu_upcall_msg m;
	struct vgpu_verdict v;
	char *cgpath = NULL;
	int out;

#ifdef CONFIG_CGROUPS
	cgpath = kmalloc(PATH_MAX, GFP_KERNEL);
	if (cgpath) {
		rcu_read_lock();
		if (cgroup_path(task_dfl_cgroup(current), cgpath, PATH_MAX) < 0) {
			kfree(cgpath);
			cgpath = NULL;
		}
		rcu_read_unlock();
	}
#endif
	vgpu_msg_init(&m, ctx, VGPU_UPCALL_OPEN);
	m.cgroup = cgpath;
	m.opener = &opener;
	out = vgpu_upcall(&m, &v);
	kfree(cgpath);
	if (out < 0)
		return out;
	if (out == VGPU_OUT_FORWARD)
		return 0;
	switch (v.action) {
	case VGPU_VERDICT_ALLOW:
		return 0;
	case VGPU_VERDICT_DENY:
		return -(int)v.error;
	default:
		return -EACCES;	/* FAIL_STATUS: refused for OPEN upcalls */
	}
}

/* Is @f a file of module @driver (and not one of ours)? */
static bool vgpu_backing_owned(const struct file *f, const char *driver)
{
	struct module *owner = f->f_op ? f->f_op->owner : NULL;

	if (!S_ISCHR(file_inode(f)->i_mode) || f->f_op == &vgpu_fops ||
	    !owner || owner == THIS_MODULE)
		return false;
	return !strcmp(module_name(owner), driver);
}

/*
 * Opens @nd's backing node: the path resolved at load, with the loader's
 * credentials. A node of our own major is refused before it is opened (no
 * recursion); a file that is not the expected driver's after.
 */
static struct file *vgpu_backing_open(const struct vgpu_node_dev *nd,
				      int flags)
{
	struct inode *inode = d_inode(nd->path.dentry);
	struct file *f;

	if (!inode || !S_ISCHR(inode->i_mode) ||
	    imajor(inode) == MAJOR(vgpu_devt))
		return ERR_PTR(-ENXIO);
	f = dentry_open(&nd->path, flags & ~(O_CREAT | O_EXCL | O_TRUNC |
					     O_NOCTTY), vgpu_backing_cred);
	if (IS_ERR(f))
		return f;
	if (!vgpu_backing_owned(f, nd->driver)) {
		fput(f);
		return ERR_PTR(-ENXIO);
	}
	return f;
}

static void vgpu_ctx_fill(struct vgpu_ctx *ctx, const struct vgpu_node_dev *nd)
{
	ctx->id = atomic64_inc_return(&vgpu_ctx_ids);
	ctx->node = nd;
	ctx->pid = task_pid_nr(current);
	ctx->tgid = task_tgid_nr(current);
	ctx->uid = from_kuid_munged(&init_user_ns, current_fsuid());
	ctx->gid = from_kgid_munged(&init_user_ns, current_fsgid());
	ctx->start_boottime = current->group_leader->start_boottime;
	mutex_init(&ctx->shadow.lock);
#ifdef CONFIG_CGROUPS
	rcu_read_lock();
	ctx->cgroup_id = cgroup_id(task_dfl_cgroup(current));
	rcu_read_unlock();
#endif
}

/*
 * The OPEN verdict comes first: an opener the daemon refuses never reaches
 * the driver. When the open fails after an allowed OPEN upcall, a CLOSE
 * event tells the daemon the context it heard of is gone.
 */
static int vgpu_open(struct inode *inode, struct file *file)
{
	struct vgpu_node_dev *nd = vgpu_nodes[iminor(inode)];
	struct vgpu_event ev = { .kind = VGPU_EVENT_CLOSE };
	bool upcalled = false;
	struct vgpu_ctx *ctx;
	struct file *backing;
	int err;

	if (!nd)
		return -ENXIO;
	ctx = kzalloc(sizeof(*ctx), GFP_KERNEL);
	if (!ctx)
		return -ENOMEM;
	vgpu_ctx_fill(ctx, nd);
	err = vgpu_slots_attach(ctx);
	if (err)
		goto err_free_ctx;

	if (vgpu_filter_wants(VGPU_FILTER_OPEN)) {
		err = vgpu_open_upcall(ctx);
		if (err)
			goto err_detach;
		upcalled = true;
	}
	backing = vgpu_backing_open(nd, file->f_flags);
	if (IS_ERR(backing)) {
		err = PTR_ERR(backing);
		goto err_closed;
	}
	ctx->backing = backing;
	err = vgpu_ctx_register(ctx);
	if (err)
		goto err_put_backing;

	file->private_data = ctx;
	vgpu_count(contexts);
	vgpu_count(opens);
	return 0;

err_put_backing:
	fput(backing);
err_closed:
	if (upcalled) {
		ev.ctx_id = ctx->id;
		vgpu_event(&ev, NULL, 0, NULL, 0);
	}
err_detach:
	vgpu_slots_detach(ctx);
err_free_ctx:
	kfree(ctx);
	return err;
}

static int vgpu_release(struct inode *inode, struct file *file)
{
	struct vgpu_ctx *ctx = file->private_data;
	struct vgpu_event ev = {
		.ctx_id = ctx->id,
		.kind = VGPU_EVENT_CLOSE,
	};

	vgpu_ctx_unregister(ctx);
	vgpu_sched_forget(ctx->id);
	vgpu_shadow_release(ctx);
	vgpu_event(&ev, NULL, 0, NULL, 0);
	vgpu_slots_detach(ctx);
	fput(ctx->backing);
	kfree_rcu(ctx, rcu);
	vgpu_uncount(contexts);
	return 0;
}

/*
 * MMAP upcall of a nvidia-uvm mapping (VGPU_FILTER_UVM_MMAP). Runs under the
 * caller's mmap_lock, held for writing: other threads of the caller that
 * fault or map wait for the verdict too, at most upcall_timeout_ms (the
 * wait is killable). The daemon never touches the caller's memory, so the
 * verdict cannot wait for this lock.
 */
static int vgpu_mmap_upcall(struct vgpu_ctx *ctx, struct vm_area_struct *vma)
{
	struct vgpu_mmap_params p = {
		.pgoff = vma->vm_pgoff,
		.length = vma->vm_end - vma->vm_start,
		.flags = (vma->vm_flags & VM_MAYSHARE) ? MAP_SHARED :
							 MAP_PRIVATE,
	};
	struct vgpu_upcall_msg m;
	struct vgpu_verdict v;
	int out;

	/* The uapi's values of flags are the x86-64 ones. */
	BUILD_BUG_ON(MAP_SHARED != 1 || MAP_PRIVATE != 2);
	if (vma->vm_flags & VM_READ)
		p.prot |= PROT_READ;
	if (vma->vm_flags & VM_WRITE)
		p.prot |= PROT_WRITE;
	if (vma->vm_flags & VM_EXEC)
		p.prot |= PROT_EXEC;
	vgpu_msg_init(&m, ctx, VGPU_UPCALL_MMAP);
	m.params = &p;
	m.params_len = sizeof(p);
	out = vgpu_upcall(&m, &v);
	if (out < 0)
		return out;
	if (out == VGPU_OUT_FORWARD)
		return 0;
	/* Only ALLOW and DENY fit an MMAP upcall. */
	return v.action == VGPU_VERDICT_DENY ? -(int)v.error : 0;
}

static int vgpu_mmap(struct file *file, struct vm_area_struct *vma)
{
	struct vgpu_ctx *ctx = file->private_data;
	struct file *b = ctx->backing;
	int err;

	if (!b->f_op->mmap)
		return -ENODEV;
	if (READ_ONCE(ctx->revoked))
		return -EIO;
	if (ctx->node->kind == VGPU_NODE_UVM &&
	    vgpu_filter_wants(VGPU_FILTER_UVM_MMAP)) {
		err = vgpu_mmap_upcall(ctx, vma);
		if (err)
			return err;
	}
	vma_set_file(vma, b);
	vgpu_count(mmaps);
	return call_mmap(b, vma);
}

static __poll_t vgpu_poll(struct file *file, struct poll_table_struct *pt)
{
	struct vgpu_ctx *ctx = file->private_data;

	return vfs_poll(ctx->backing, pt);
}

const struct file_operations vgpu_fops = {
	.owner		= THIS_MODULE,
	.open		= vgpu_open,
	.release	= vgpu_release,
	.unlocked_ioctl	= vgpu_ioctl,
	.compat_ioctl	= vgpu_ioctl,
	.mmap		= vgpu_mmap,
	.poll		= vgpu_poll,
	.llseek		= noop_llseek,
};

static char *vgpu_devnode(VGPU_DEVNODE_CONST struct device *dev, umode_t *mode)
{
	if (mode)
		*mode = 0666;
	return kasprintf(GFP_KERNEL, "vgpu/%s", dev_name(dev));
}

static void vgpu_nodes_free(void)
{
	int i;

	for (i = 0; i < VGPU_MINORS; i++) {
		if (!vgpu_nodes[i])
			continue;
		path_put(&vgpu_nodes[i]->path);
		kfree(vgpu_nodes[i]);
		vgpu_nodes[i] = NULL;
	}
}

/*
 * Resolves @nd's backing node under backing_dir and opens it once to check
 * it. Return: 0 when it is fit, -ENOENT when there is none, or why not.
 */
static int vgpu_node_resolve(struct vgpu_node_dev *nd)
{
	struct file *f;
	char *bpath;
	int err;

	bpath = kasprintf(GFP_KERNEL, "%s/%s", vgpu_backing_dir, nd->name);
	if (!bpath)
		return -ENOMEM;
	err = kern_path(bpath, LOOKUP_FOLLOW, &nd->path);
	if (err)
		goto out;
	f = vgpu_backing_open(nd, O_RDWR);
	if (IS_ERR(f)) {
		err = PTR_ERR(f);
		pr_warn("vgpu: %s is not a %s device (%d): no node %s\n",
			bpath, nd->driver, err, nd->name);
		path_put(&nd->path);
		goto out;
	}
	fput(f);
out:
	kfree(bpath);
	return err;
}

/* Adds the node of @minor when its backing node exists and is fit. */
static int vgpu_node_probe(unsigned int minor, u32 kind, u32 index,
			   const char *name)
{
	struct vgpu_node_dev *nd;
	int err;

	nd = kzalloc(sizeof(*nd), GFP_KERNEL);
	if (!nd)
		return -ENOMEM;
	nd->kind = kind;
	nd->index = index;
	strscpy(nd->name, name, sizeof(nd->name));
	nd->driver = kind == VGPU_NODE_UVM ? vgpu_backing_uvm_driver :
					     vgpu_backing_driver;
	err = vgpu_node_resolve(nd);
	if (err) {
		kfree(nd);
		return err == -ENOMEM ? err : 0;
	}
	vgpu_nodes[minor] = nd;
	return 0;
}

static int vgpu_nodes_probe(void)
{
	char name[16];
	unsigned int i;
	int err;

	err = vgpu_node_probe(VGPU_MINOR_CTL, VGPU_NODE_CTL, 0, "nvidiactl");
	if (err)
		return err;
	if (!vgpu_nodes[VGPU_MINOR_CTL]) {
		pr_err("vgpu: no backing %s/nvidiactl of %s\n",
		       vgpu_backing_dir, vgpu_backing_driver);
		return -ENODEV;
	}
	for (i = 0; i < VGPU_MAX_GPUS; i++) {
		snprintf(name, sizeof(name), "nvidia%u", i);
		err = vgpu_node_probe(i, VGPU_NODE_GPU, i, name);
		if (err)
			return err;
	}
	return vgpu_node_probe(VGPU_MINOR_UVM, VGPU_NODE_UVM, 0, "nvidia-uvm");
}

static void vgpu_devices_destroy(void)
{
	int i;

	for (i = VGPU_MINORS - 1; i >= 0; i--) {
		if (vgpu_nodes[i] && vgpu_nodes[i]->dev) {
			device_destroy(vgpu_class, MKDEV(MAJOR(vgpu_devt), i));
			vgpu_nodes[i]->dev = NULL;
		}
	}
}

static int vgpu_devices_create(void)
{
	struct device *dev;
	int i;

	for (i = 0; i < VGPU_MINORS; i++) {
		if (!vgpu_nodes[i])
			continue;
		/* The device name is the backing node's name. */
		dev = device_create(vgpu_class, NULL,
				    MKDEV(MAJOR(vgpu_devt), i), NULL, "%s",
				    vgpu_nodes[i]->name);
		if (IS_ERR(dev)) {
			vgpu_devices_destroy();
			return PTR_ERR(dev);
		}
		vgpu_nodes[i]->dev = dev;
	}
	return 0;
}

/*
 * The loader's credentials, our major (so that no backing can be ours), the
 * backing nodes, then the files: undone in reverse order by the error path
 * and by exit alike.
 */
int vgpu_chardev_init(void)
{
	int err;

	vgpu_backing_cred = get_current_cred();
	err = alloc_chrdev_region(&vgpu_devt, 0, VGPU_MINORS, "vgpu");
	if (err)
		goto err_cred;
	err = vgpu_nodes_probe();
	if (err)
		goto err_nodes;
	vgpu_class = vgpu_class_create("vgpu");
	if (IS_ERR(vgpu_class)) {
		err = PTR_ERR(vgpu_class);
		goto err_nodes;
	}
	vgpu_class->devnode = vgpu_devnode;
	cdev_init(&vgpu_cdev, &vgpu_fops);
	vgpu_cdev.owner = THIS_MODULE;
	err = cdev_add(&vgpu_cdev, vgpu_devt, VGPU_MINORS);
	if (err)
		goto err_class;
	err = vgpu_devices_create();
	if (err)
		goto err_cdev;
	return 0;

err_cdev:
	cdev_del(&vgpu_cdev);
err_class:
	class_destroy(vgpu_class);
err_nodes:
	vgpu_nodes_free();
	unregister_chrdev_region(vgpu_devt, VGPU_MINORS);
err_cred:
	put_cred(vgpu_backing_cred);
	return err;
}

void vgpu_chardev_exit(void)
{
	vgpu_devices_destroy();
	cdev_del(&vgpu_cdev);
	class_destroy(vgpu_class);
	vgpu_nodes_free();
	unregister_chrdev_region(vgpu_devt, VGPU_MINORS);
	put_cred(vgpu_backing_cred);
}
