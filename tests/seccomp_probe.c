/*
 * Tries system calls the sandbox's seccomp profile refuses, each with arguments that
 * would be harmless even if the call went through (bad magic, NULL pointers, bad fds,
 * the current time), and prints "name ret errno" per call. Built static on the host by
 * tests/test_seccomp.py and copied into a sandbox.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static void report(const char *name, long ret)
{
	printf("%s %ld %d\n", name, ret, ret < 0 ? errno : 0);
	fflush(stdout);
}

static long try_clone(unsigned long flags)
{
	long r = syscall(SYS_clone, flags | SIGCHLD, 0, 0, 0, 0);
	if (r == 0)
		_exit(0); /* it went through: the child leaves at once */
	if (r > 0)
		waitpid((pid_t)r, NULL, 0);
	return r;
}

static void *thread_main(void *arg)
{
	return arg;
}

static void one(const char *n)
{
	struct timespec now;
	clock_gettime(CLOCK_REALTIME, &now);
	errno = 0;
#define T(name, call) \
	if (!strcmp(n, name)) { \
		report(name, (long)(call)); \
		return; \
	}
	T("reboot", syscall(SYS_reboot, 0, 0, 0, 0));
	T("kexec_load", syscall(SYS_kexec_load, 0, 0, 0, 0));
	T("kexec_file_load", syscall(SYS_kexec_file_load, -1, -1, 0, "", 0));
	T("init_module", syscall(SYS_init_module, 0, 0, ""));
	T("finit_module", syscall(SYS_finit_module, -1, "", 0));
	T("delete_module", syscall(SYS_delete_module, "dsec_no_such_module", 0));
	T("swapon", syscall(SYS_swapon, "/dsec-no-such-file", 0));
	T("swapoff", syscall(SYS_swapoff, "/dsec-no-such-file"));
	T("mount", syscall(SYS_mount, "none", "/dsec-no-such-dir", "tmpfs", 0, 0));
	T("umount2", syscall(SYS_umount2, "/dsec-no-such-dir", 0));
	T("pivot_root", syscall(SYS_pivot_root, "/dsec-no-such-dir", "/dsec-no-such-dir"));
	T("open_tree", syscall(SYS_open_tree, -1, "/dsec-no-such-dir", 0));
	T("move_mount", syscall(SYS_move_mount, -1, "", -1, "", 0));
	T("fsopen", syscall(SYS_fsopen, "dsec-no-such-fs", 0));
	T("fsmount", syscall(SYS_fsmount, -1, 0, 0));
	T("fspick", syscall(SYS_fspick, -1, "/dsec-no-such-dir", 0));
	T("mount_setattr", syscall(SYS_mount_setattr, -1, "", 0, 0, 0));
	T("unshare", syscall(SYS_unshare, CLONE_NEWNS));
	T("setns", syscall(SYS_setns, -1, 0));
	T("clone_newuser", try_clone(CLONE_NEWUSER));
	T("clone_newnet", try_clone(CLONE_NEWNET));
	T("keyctl", syscall(SYS_keyctl, 0 /* KEYCTL_GET_KEYRING_ID */, -2, 0));
	T("add_key", syscall(SYS_add_key, "user", "dsec", "x", 1, -2));
	T("request_key", syscall(SYS_request_key, "user", "dsec", 0, 0));
	T("bpf", syscall(SYS_bpf, 0, 0, 0));
	T("perf_event_open", syscall(SYS_perf_event_open, 0, 0, -1, -1, 0));
	T("userfaultfd", syscall(SYS_userfaultfd, 0));
	T("ptrace", syscall(SYS_ptrace, 16 /* PTRACE_ATTACH */, 1, 0, 0));
	T("process_vm_readv", syscall(SYS_process_vm_readv, 1, 0, 0, 0, 0, 0));
	T("process_vm_writev", syscall(SYS_process_vm_writev, 1, 0, 0, 0, 0, 0));
	T("clock_settime", syscall(SYS_clock_settime, CLOCK_REALTIME, &now));
	T("clock_adjtime", syscall(SYS_clock_adjtime, CLOCK_REALTIME, 0));
	T("adjtimex", syscall(SYS_adjtimex, 0));
	T("settimeofday", syscall(SYS_settimeofday, 0, 0));
	T("acct", syscall(SYS_acct, 0));
	T("quotactl", syscall(SYS_quotactl, 0, 0, 0, 0));
	T("syslog", syscall(SYS_syslog, 10 /* SIZE_BUFFER: a read */, 0, 0));
	T("iopl", syscall(SYS_iopl, 0));
	T("ioperm", syscall(SYS_ioperm, 0, 0, 0));
	T("open_by_handle_at", syscall(SYS_open_by_handle_at, -1, 0, 0));
	T("name_to_handle_at", syscall(SYS_name_to_handle_at, -1, "", 0, 0, 0));
	T("vhangup", syscall(SYS_vhangup));
	T("lookup_dcookie", syscall(SYS_lookup_dcookie, 0, 0, 0));
	T("kcmp", syscall(SYS_kcmp, 1, 1, 0, 0, 0));
	T("pidfd_getfd", syscall(SYS_pidfd_getfd, -1, 0, 0));
	T("sethostname", syscall(SYS_sethostname, "x", 1));
	T("socket_vsock", syscall(SYS_socket, 40 /* AF_VSOCK */, SOCK_STREAM, 0));
	T("socket_unix", ({
		long fd = syscall(SYS_socket, AF_UNIX, SOCK_STREAM, 0);
		if (fd >= 0)
			close((int)fd);
		fd;
	}));
	/* not reported, but refused with the errno that makes libc fall back */
	T("clone3", syscall(SYS_clone3, 0, 0));
	T("io_uring_setup", syscall(SYS_io_uring_setup, 1, 0));
	T("personality_addr_no_randomize", syscall(SYS_personality, 0x0040000));
	/* allowed: normal work */
	T("personality_query", syscall(SYS_personality, 0xffffffff));
	T("fork", try_clone(0));
	T("thread", ({
		pthread_t t;
		int e = pthread_create(&t, NULL, thread_main, NULL);
		if (!e)
			pthread_join(t, NULL);
		errno = e;
		e ? -1 : 0;
	}));
	fprintf(stderr, "unknown probe %s\n", n);
	exit(2);
}

int main(int argc, char **argv)
{
	for (int i = 1; i < argc; i++)
		one(argv[i]);
	return 0;
}
