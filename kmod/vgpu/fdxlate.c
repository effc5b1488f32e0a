// SPDX-License-Identifier: GPL-2.0
/*
 * fd translation. Some NVIDIA escapes carry fd numbers that the driver
 * resolves in the caller's fd table (nv_get_file_private(): fget, a char
 * device of its major and the expected minor, then the file's private
 * data). Behind our emulated files those numbers name our files, so for the
 * duration of the call a proxy file is installed under a temporary fd
 * number, which replaces the caller's number in the params; the caller's
 * number is put back afterwards.
 *
 * The proxy is never the backing file: the caller's fd table is shared
 * with its threads and copied by fork, so whatever lies at the temporary fd
 * may be kept. A proxy is a file on a pseudo filesystem of ours: a char
 * inode with the backing file's device number during the call only (0
 * after), the backing file's private data (the driver keeps and reads a
 * registered control file), and file operations without ioctl, mmap, read
 * or write. Its inode's open is the default no_open: a proxy cannot be
 * reopened through /proc/<pid>/fd either. A proxy holds a reference on the
 * caller's emulated file (which holds the backing file): a proxy that a
 * tenant keeps holds that context, and the driver state it names, alive.
 *
 * An fd field that names no emulated file of ours reaches the driver as -1,
 * which it refuses: only files the driver resolves are proxies of calls in
 * flight.
 */
#include <linux/dcache.h>
#include <linux/fcntl.h>
#include <linux/fdtable.h>
#include <linux/file.h>
#include <linux/fs.h>
#include <linux/fs_context.h>
#include <linux/module.h>
#include <linux/moduleparam.h>
#include <linux/mount.h>
#include <linux/pseudo_fs.h>
#include <linux/rcupdate.h>
#include <linux/sched.h>
#include <linux/stddef.h>
#include <linux/sysfs.h>
#include <linux/uaccess.h>

#include "compat.h"
#include "vgpu.h"

#define VGPU_PROXYFS_MAGIC	0x76677078	/* "vgpx" */

/* Written at init and exit only; in between read-only. */
static struct vfsmount *vgpu_proxy_mnt;
/* Proxies handed out since load: a gauge, read-only. */
static atomic64_t vgpu_proxies = ATOMIC64_INIT(0);

static int vgpu_proxies_get(char *buf, const struct kernel_param *kp)
{
	return sysfs_emit(buf, "%lld\n", (long long)atomic64_read(&vgpu_proxies));
}

static const struct kernel_param_ops vgpu_proxies_ops = {
	.get = vgpu_proxies_get,
};

module_param_cb(proxies, &vgpu_proxies_ops, NULL, 0444);
MODULE_PARM_DESC(proxies, "proxy files handed to the driver for fd arguments (read-only)");

/**
 * struct vgpu_fd_arg - an escape that carries an fd
 * @node: enum vgpu_node it is issued on
 * @nr: escape number
 * @size: exact params size
 * @off: offset of the int fd in the params
 */
struct vgpu_fd_arg {
	u8 node;
	u8 nr;
	u16 size;
	u16 off;
};

#define VGPU_FD_ARG(node, nr, type, field) \
	{ node, nr, sizeof(struct type), offsetof(struct type, field) }

static const struct vgpu_fd_arg vgpu_fd_args[] = {
	VGPU_FD_ARG(VGPU_NODE_GPU, NV_ESC_REGISTER_FD, nv_register_fd, ctl_fd),
	VGPU_FD_ARG(VGPU_NODE_CTL, NV_ESC_RM_MAP_MEMORY, nvos33_with_fd, fd),
	VGPU_FD_ARG(VGPU_NODE_GPU, NV_ESC_RM_ALLOC_MEMORY, nvos02_with_fd, fd),
};

/* Sets in @map the escape numbers of @node that carry an fd. */
void vgpu_fdx_mark(unsigned long *map, u32 node)
{
	size_t i;

	for (i = 0; i < ARRAY_SIZE(vgpu_fd_args); i++)
		if (vgpu_fd_args[i].node == node)
			__set_bit(vgpu_fd_args[i].nr, map);
}

/*
 * The last reference to a proxy is gone (the temporary fd closed, and any
 * copy a tenant kept): drops its reference on the emulated file. The
 * inode is the proxy's own, so nothing else reads i_private.
 */
static int vgpu_proxy_release(struct inode *inode, struct file *file)
{
	struct file *ours = inode->i_private;

	inode->i_private = NULL;
	if (ours)
		fput(ours);
	return 0;
}

/*
 * Inert: no ioctl, mmap, read or write; a kept proxy can do nothing. A
 * proxy holds the module through .owner and through the emulated file it
 * references; both are let go before the dput and mntput that end its
 * __fput, which vgpu_fdx_exit() waits for.
 */
static const struct file_operations vgpu_proxy_fops = {
	.owner		= THIS_MODULE,
	.release	= vgpu_proxy_release,
};

/* Its name in /proc/<pid>/fd; d_dname writes it at the end of @buf. */
static char *vgpu_proxy_dname(struct dentry *dentry, char *buf, int len)
{
	char name[32];
	int n;

	n = snprintf(name, sizeof(name), "%s:[%lu]", dentry->d_name.name,
		     d_inode(dentry)->i_ino) + 1;
	if (n > len)
		return ERR_PTR(-ENAMETOOLONG);
	buf += len - n;
	memcpy(buf, name, n);
	return buf;
}

static const struct dentry_operations vgpu_proxy_dops = {
	.d_dname	= vgpu_proxy_dname,
};

static int vgpu_proxyfs_init_fs_context(struct fs_context *fc)
{
	struct pseudo_fs_context *ctx = init_pseudo(fc, VGPU_PROXYFS_MAGIC);

	if (!ctx)
		return -ENOMEM;
	ctx->dops = &vgpu_proxy_dops;
	return 0;
}

/*
 * The superblock's end: in kern_unmount() at exit, or, when a proxy's
 * __fput still held the mount then, in its last mntput. Written before
 * vgpu_proxyfs_gone completes, read after.
 */
static DECLARE_COMPLETION(vgpu_proxyfs_gone);
static struct task_struct *vgpu_proxyfs_killer;

static void vgpu_proxyfs_kill_sb(struct super_block *sb)
{
	kill_anon_super(sb);
	vgpu_proxyfs_killer = current;
	complete(&vgpu_proxyfs_gone);
}

/*
 * No .owner: the mount lives from init to exit, and a superblock holding a
 * reference on its module would keep the module from unloading. Every
 * proxy holds the module instead (vgpu_proxy_fops).
 */
static struct file_system_type vgpu_proxyfs_type = {
	.name		= "vgpu_proxy",
	.init_fs_context = vgpu_proxyfs_init_fs_context,
	.kill_sb	= vgpu_proxyfs_kill_sb,
};

/*
 * A proxy of the emulated file @ours (referenced by the caller): one
 * reference returned, or an ERR_PTR.
 */
static struct file *vgpu_proxy_new(struct file *ours)
{
	struct vgpu_ctx *ctx = ours->private_data;
	struct file *b = ctx->backing;
	struct inode *inode;
	struct file *f;

	inode = new_inode(vgpu_proxy_mnt->mnt_sb);
	if (!inode)
		return ERR_PTR(-ENOMEM);
	inode->i_ino = get_next_ino();
	/* Not init_special_inode(): i_fop stays no_open, never the chrdev's. */
	inode->i_mode = S_IFCHR | 0600;
	inode->i_rdev = file_inode(b)->i_rdev;
	inode->i_private = get_file(ours);
	/* The file's, dropped by its last fput (fops_put of .owner). */
	__module_get(THIS_MODULE);
	f = alloc_file_pseudo(inode, vgpu_proxy_mnt, "vgpu-proxy", O_RDWR,
			      &vgpu_proxy_fops);
	if (IS_ERR(f))
		goto err_put;
	f->private_data = b->private_data;
	atomic64_inc(&vgpu_proxies);
	return f;

err_put:
	module_put(THIS_MODULE);
	fput(ours);
	inode->i_private = NULL;
	iput(inode);
	return f;
}

/* The fd field, in the shadow's kernel view when there is one. */
static int vgpu_fdx_get(const struct vgpu_fdx *x, int *fd)
{
	if (x->kptr) {
		*fd = get_unaligned(x->kptr);
		return 0;
	}
	return get_user(*fd, x->uptr);
}

static int vgpu_fdx_put(const struct vgpu_fdx *x, int fd)
{
	if (x->kptr) {
		put_unaligned(fd, x->kptr);
		return 0;
	}
	return put_user(fd, x->uptr);
}

/**
 * vgpu_pseudo_file - a file of ours on an inode of its own (shadow.c)
 * @name: its name in /proc/<pid>/maps and fd, "@name:[ino]"
 * @fops: its operations; @fops->owner is held for the file's life
 * @priv: its private_data
 *
 * The inode is an anonymous one (alloc_anon_inode): its own address space,
 * whose dirty tracking is a no-op, and no open.
 *
 * Return: one reference, or an ERR_PTR.
 */
struct file *vgpu_pseudo_file(const char *name,
			      const struct file_operations *fops, void *priv)
{
	struct inode *inode;
	struct file *f;

	inode = alloc_anon_inode(vgpu_proxy_mnt->mnt_sb);
	if (IS_ERR(inode))
		return ERR_CAST(inode);
	/* The file's, dropped by its last fput (fops_put of .owner). */
	__module_get(fops->owner);
	f = alloc_file_pseudo(inode, vgpu_proxy_mnt, name, O_RDWR, fops);
	if (IS_ERR(f)) {
		module_put(fops->owner);
		iput(inode);
		return f;
	}
	f->private_data = priv;
	return f;
}

/**
 * vgpu_fdx_prepare - translate the fd argument of a call, if it has one
 * @x: state for vgpu_fdx_finish()
 * @node: enum vgpu_node
 * @nr: escape number
 * @size: params size
 * @params: the params the driver will read
 * @kparams: the kernel's view of @params when they lie in a shadow (the
 *	fd is read and written there, never through the tenant's mapping),
 *	or NULL
 *
 * An fd of one of our emulated files becomes a temporary fd of a proxy of
 * it; any other fd becomes -1.
 *
 * Return: 0 (also when the call has no fd argument), or a negative errno:
 * the call must then fail without reaching the driver.
 */
int vgpu_fdx_prepare(struct vgpu_fdx *x, u32 node, u32 nr, u32 size,
		     void __user *params, void *kparams)
{
	const struct vgpu_fd_arg *a = NULL;
	struct file *f, *proxy;
	int fd, tmp, err;
	size_t i;

	memset(x, 0, sizeof(*x));
	for (i = 0; i < ARRAY_SIZE(vgpu_fd_args); i++) {
		if (vgpu_fd_args[i].node == node && vgpu_fd_args[i].nr == nr &&
		    vgpu_fd_args[i].size == size) {
			a = &vgpu_fd_args[i];
			break;
		}
	}
	if (!a)
		return 0;
	x->uptr = params + a->off;
	x->kptr = kparams ? kparams + a->off : NULL;
	/* Unreadable now, it could be readable by the driver's read. */
	if (vgpu_fdx_get(x, &fd))
		goto err_none;
	f = fget(fd);
	if (f && f->f_op != &vgpu_fops) {
		fput(f);
		f = NULL;
	}
	if (!f) {
		/* Not ours: the driver sees no fd at all. */
		if (vgpu_fdx_put(x, -1))
			goto err_none;
		x->orig_fd = fd;
		return 0;
	}

	proxy = vgpu_proxy_new(f);
	if (IS_ERR(proxy)) {
		err = PTR_ERR(proxy);
		goto err_ours;
	}
	tmp = get_unused_fd_flags(O_CLOEXEC);
	if (tmp < 0) {
		err = tmp;
		goto err_proxy;
	}
	if (vgpu_fdx_put(x, tmp)) {
		err = -EFAULT;
		goto err_fd;
	}
	/* The fd table's reference, and ours until the call is over. */
	fd_install(tmp, get_file(proxy));
	x->ours = f;
	x->proxy = proxy;
	x->orig_fd = fd;
	x->tmp_fd = tmp;
	return 0;

err_fd:
	put_unused_fd(tmp);
err_proxy:
	fput(proxy);
err_ours:
	fput(f);
	memset(x, 0, sizeof(*x));
	return err;

err_none:
	memset(x, 0, sizeof(*x));
	return -EFAULT;
}

/*
 * After the driver call: the proxy no longer resolves in the driver, the
 * caller's fd number is put back and the temporary fd closed. A copy of
 * the proxy that a sibling thread or a child kept stays, inert.
 */
void vgpu_fdx_finish(struct vgpu_fdx *x)
{
	if (!x->uptr)
		return;
	if (x->proxy)
		WRITE_ONCE(file_inode(x->proxy)->i_rdev, 0);
	if (vgpu_fdx_put(x, x->orig_fd))
		pr_debug("vgpu: could not restore fd %d in params\n",
			 x->orig_fd);
	if (x->proxy) {
		close_fd(x->tmp_fd);
		fput(x->proxy);
		fput(x->ours);
	}
	memset(x, 0, sizeof(*x));
}

/* The proxies' filesystem, mounted from load to unload. */
int vgpu_fdx_init(void)
{
	vgpu_proxy_mnt = kern_mount(&vgpu_proxyfs_type);
	if (IS_ERR(vgpu_proxy_mnt))
		return PTR_ERR(vgpu_proxy_mnt);
	return 0;
}

/*
 * No proxy is left open: each one holds the module (vgpu_proxy_fops). But
 * the last one's __fput may still be between its module_put and its
 * mntput: then the superblock dies there, not here. Wait for it, and for
 * that task to leave the code that follows our kill_sb (it still reads
 * vgpu_proxyfs_type), before the module's memory goes.
 */
void vgpu_fdx_exit(void)
{
	kern_unmount(vgpu_proxy_mnt);
	wait_for_completion(&vgpu_proxyfs_gone);
	if (vgpu_proxyfs_killer != current)
		synchronize_rcu_tasks();
}
