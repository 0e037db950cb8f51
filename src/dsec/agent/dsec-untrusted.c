/*
 * dsec-untrusted: run the agent's code from inside a verifier, as someone who cannot
 * touch the verdict.
 *
 * A grader that must execute the agent's work (run its program on hidden inputs, import
 * its module in hidden tests) calls `$DSEC_UNTRUSTED CMD ARGS...` instead of CMD. The
 * command then runs:
 *
 *   - as an unprivileged user (default 65534:65534, `--user UID[:GID]`), no supplementary
 *     groups, no capabilities (a uid change from root drops them), no_new_privs;
 *   - under a Landlock domain that allows the whole file system *except* the protected
 *     paths (the answers, the grader suite) and /.dsec (the result directory the grader
 *     writes its verdict to, this program), whatever their file modes say: an agent's
 *     program can read neither the expected output nor forge the result files;
 *     where the kernel has Landlock scopes (ABI >= 6) it can also neither signal
 *     processes outside its domain nor reach abstract unix sockets outside it;
 *   - with no file descriptor of the grader but stdin, stdout and stderr;
 *   - with HOME=/tmp (the grader's home is under /.dsec);
 *   - in a session of its own; when it exits, every process left running as its user
 *     (double forks, setsid: it does not matter) is killed, so nothing lingers to change
 *     files after the grader has read them.
 *
 * Fails closed: if any of that cannot be done (no Landlock, a protected path that cannot
 * be excluded), the command does not run and the exit status is 126.
 *
 * The protected paths are read from /.dsec/verify/hidden (one absolute path per line,
 * written by the platform, read-only). The exit status is the command's, 128+N when a
 * signal N ended it.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <grp.h>
#include <limits.h>
#include <linux/landlock.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

/* Newer than the oldest headers we build with (values from the kernel's uapi). */
#ifndef LANDLOCK_ACCESS_FS_TRUNCATE
#define LANDLOCK_ACCESS_FS_TRUNCATE (1ULL << 14)
#endif
#ifndef LANDLOCK_SCOPE_SIGNAL
#define LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET (1ULL << 0)
#define LANDLOCK_SCOPE_SIGNAL (1ULL << 1)
#endif

#define HIDDEN_LIST "/.dsec/verify/hidden"
#define MAX_HIDDEN 64
#define FAIL 126

static char *hidden[MAX_HIDDEN];
static int nhidden;
static int ruleset = -1;
static uint64_t dir_rights, file_rights;

static void __attribute__((noreturn, format(printf, 1, 2))) die(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	fputs("dsec-untrusted: ", stderr);
	vfprintf(stderr, fmt, ap);
	fputc('\n', stderr);
	va_end(ap);
	_exit(FAIL);
}

static int is_under(const char *path, const char *prefix)
{
	size_t n = strlen(prefix);
	if (n == 1 && prefix[0] == '/')
		return 1;
	return strncmp(path, prefix, n) == 0 && (path[n] == '\0' || path[n] == '/');
}

static void hide(const char *path)
{
	char real[PATH_MAX];
	if (nhidden >= MAX_HIDDEN)
		die("too many protected paths");
	/* A protected path reached through a link is excluded where it really is. */
	const char *p = realpath(path, real) ? real : path;
	if (strcmp(p, "/") == 0)
		die("refusing to hide the root directory");
	hidden[nhidden] = strdup(p);
	if (!hidden[nhidden])
		die("out of memory");
	nhidden++;
}

static void load_hidden(void)
{
	hide("/.dsec");
	FILE *f = fopen(HIDDEN_LIST, "re");
	if (!f) {
		if (errno == ENOENT)
			return; /* not in a verifier: nothing protected to hide */
		die("cannot read %s: %s", HIDDEN_LIST, strerror(errno));
	}
	char line[PATH_MAX + 2];
	while (fgets(line, sizeof line, f)) {
		line[strcspn(line, "\n")] = '\0';
		if (line[0] == '/')
			hide(line);
	}
	fclose(f);
}

static int hidden_exact(const char *path)
{
	for (int i = 0; i < nhidden; i++)
		if (strcmp(path, hidden[i]) == 0)
			return 1;
	return 0;
}

/* A strict ancestor of a hidden path: allowed only entry by entry. */
static int hidden_below(const char *path)
{
	for (int i = 0; i < nhidden; i++)
		if (strcmp(path, hidden[i]) != 0 && is_under(hidden[i], path))
			return 1;
	return 0;
}

static int touches_hidden(const char *path)
{
	for (int i = 0; i < nhidden; i++)
		if (is_under(path, hidden[i]) || is_under(hidden[i], path))
			return 1;
	return 0;
}

static void allow(const char *path)
{
	int fd = open(path, O_PATH | O_CLOEXEC);
	if (fd < 0)
		return; /* vanished or unreachable: stays denied (fail closed) */
	struct stat st;
	if (fstat(fd, &st) < 0) {
		close(fd);
		return;
	}
	struct landlock_path_beneath_attr rule = {
		.allowed_access = S_ISDIR(st.st_mode) ? dir_rights : file_rights,
		.parent_fd = fd,
	};
	if (syscall(SYS_landlock_add_rule, ruleset, LANDLOCK_RULE_PATH_BENEATH, &rule, 0) < 0)
		die("landlock_add_rule %s: %s", path, strerror(errno));
	close(fd);
}

/* Allow every entry of dir except the hidden ones; descend where a hidden path lies
 * below. Iterative over the (short) chain of ancestors, since recursion depth is the
 * depth of a protected path, bounded by PATH_MAX. */
static void allow_except(const char *dir, int depth)
{
	if (depth > 64)
		die("protected path nested too deep");
	DIR *d = opendir(dir);
	if (!d)
		die("cannot list %s: %s", dir, strerror(errno));
	struct dirent *e;
	while ((e = readdir(d))) {
		if (strcmp(e->d_name, ".") == 0 || strcmp(e->d_name, "..") == 0)
			continue;
		char path[PATH_MAX];
		if (snprintf(path, sizeof path, "%s/%s", strcmp(dir, "/") ? dir : "", e->d_name) >= (int)sizeof path)
			continue;
		if (hidden_exact(path))
			continue;
		struct stat st;
		if (lstat(path, &st) < 0)
			continue;
		if (hidden_below(path)) {
			if (!S_ISDIR(st.st_mode))
				die("%s leads to a protected path but is not a directory", path);
			allow_except(path, depth + 1);
			continue;
		}
		if (S_ISLNK(st.st_mode)) {
			/* A rule follows the link: never let one lead into a protected path. */
			char real[PATH_MAX];
			if (!realpath(path, real) || touches_hidden(real))
				continue;
		}
		allow(path);
	}
	closedir(d);
}

static void restrict_self(void)
{
	long abi = syscall(SYS_landlock_create_ruleset, NULL, 0, LANDLOCK_CREATE_RULESET_VERSION);
	if (abi < 1)
		die("Landlock is not available (%s): cannot keep the protected paths from the agent's "
		    "code", strerror(errno));
	file_rights = LANDLOCK_ACCESS_FS_EXECUTE | LANDLOCK_ACCESS_FS_WRITE_FILE | LANDLOCK_ACCESS_FS_READ_FILE;
	dir_rights = file_rights | LANDLOCK_ACCESS_FS_READ_DIR | LANDLOCK_ACCESS_FS_REMOVE_DIR |
		     LANDLOCK_ACCESS_FS_REMOVE_FILE | LANDLOCK_ACCESS_FS_MAKE_CHAR | LANDLOCK_ACCESS_FS_MAKE_DIR |
		     LANDLOCK_ACCESS_FS_MAKE_REG | LANDLOCK_ACCESS_FS_MAKE_SOCK | LANDLOCK_ACCESS_FS_MAKE_FIFO |
		     LANDLOCK_ACCESS_FS_MAKE_BLOCK | LANDLOCK_ACCESS_FS_MAKE_SYM;
	if (abi >= 2)
		dir_rights |= LANDLOCK_ACCESS_FS_REFER; /* renames across directories (pip, git) */
	if (abi >= 3) {
		file_rights |= LANDLOCK_ACCESS_FS_TRUNCATE;
		dir_rights |= LANDLOCK_ACCESS_FS_TRUNCATE;
	}
	struct {
		uint64_t handled_access_fs, handled_access_net, scoped;
	} attr = {.handled_access_fs = dir_rights};
	size_t size = 8;
	if (abi >= 6) {
		attr.scoped = LANDLOCK_SCOPE_SIGNAL | LANDLOCK_SCOPE_ABSTRACT_UNIX_SOCKET;
		size = sizeof attr;
	}
	ruleset = (int)syscall(SYS_landlock_create_ruleset, &attr, size, 0);
	if (ruleset < 0)
		die("landlock_create_ruleset: %s", strerror(errno));
	allow_except("/", 0);
	if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
		die("no_new_privs: %s", strerror(errno));
	if (syscall(SYS_landlock_restrict_self, ruleset, 0) < 0)
		die("landlock_restrict_self: %s", strerror(errno));
	close(ruleset);
}

static void parse_user(const char *spec, uid_t *uid, gid_t *gid)
{
	char *end;
	errno = 0;
	unsigned long u = strtoul(spec, &end, 10);
	if (errno || end == spec || (*end && *end != ':') || u == 0 || u > 0xfffffffeUL)
		die("--user wants a non-zero UID[:GID], got '%s'", spec);
	unsigned long g = u;
	if (*end == ':') {
		const char *gs = end + 1;
		g = strtoul(gs, &end, 10);
		if (errno || end == gs || *end || g == 0 || g > 0xfffffffeUL)
			die("--user wants a non-zero UID[:GID], got '%s'", spec);
	}
	*uid = (uid_t)u;
	*gid = (gid_t)g;
}

/* Whether a process runs as uid (any of its real, effective, saved or fs ids): read
 * from /proc/PID/status, which a process cannot hide by making itself non-dumpable. */
static int runs_as(const char *pid, uid_t uid)
{
	char path[64], buf[4096];
	snprintf(path, sizeof path, "/proc/%s/status", pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return 0;
	ssize_t n = read(fd, buf, sizeof buf - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = '\0';
	char *line = strstr(buf, "\nUid:");
	if (!line)
		return 0;
	unsigned long ids[4];
	if (sscanf(line + 5, "%lu %lu %lu %lu", &ids[0], &ids[1], &ids[2], &ids[3]) != 4)
		return 0;
	for (int i = 0; i < 4; i++)
		if (ids[i] == (unsigned long)uid)
			return 1;
	return 0;
}

/* SIGKILL every process of uid in this pid namespace; how many were found. A walk of
 * /proc rather than kill(-1): the sandbox's seccomp profile refuses (and records) a
 * broadcast kill from anyone. */
static int kill_round(uid_t uid)
{
	DIR *d = opendir("/proc");
	if (!d)
		return 0;
	int found = 0;
	struct dirent *e;
	while ((e = readdir(d))) {
		if (e->d_name[0] < '1' || e->d_name[0] > '9')
			continue;
		if (!runs_as(e->d_name, uid))
			continue;
		pid_t pid = (pid_t)strtol(e->d_name, NULL, 10);
		if (pid > 1 && pid != getpid() && kill(pid, SIGKILL) == 0)
			found++;
	}
	closedir(d);
	return found;
}

static void reap_children(void)
{
	while (waitpid(-1, NULL, WNOHANG) > 0)
		;
}

/* Kill what the command left running as its user (double forks and setsid included:
 * we are their subreaper, so the dead come back to us and are reaped here, and a
 * zombie's status no longer names the user). */
static void kill_user(uid_t uid)
{
	for (int i = 0; i < 2000; i++) {
		reap_children();
		if (kill_round(uid) == 0)
			break;
		usleep(500);
	}
	reap_children();
}

int main(int argc, char **argv)
{
	uid_t uid = 65534;
	gid_t gid = 65534;
	int i = 1;
	for (; i < argc; i++) {
		if (strcmp(argv[i], "--") == 0) {
			i++;
			break;
		}
		if (strcmp(argv[i], "--user") == 0 && i + 1 < argc) {
			parse_user(argv[++i], &uid, &gid);
			continue;
		}
		if (argv[i][0] == '-')
			die("unknown option %s (usage: dsec-untrusted [--user UID[:GID]] [--] CMD ARGS...)", argv[i]);
		break;
	}
	if (i >= argc)
		die("usage: dsec-untrusted [--user UID[:GID]] [--] CMD ARGS...");
	if (geteuid() != 0)
		die("must be started by the grader as root (it drops to uid %u itself)", (unsigned)uid);
	load_hidden();
	prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
	prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
	fflush(NULL);
	pid_t pid = fork();
	if (pid < 0)
		die("fork: %s", strerror(errno));
	if (pid == 0) {
		setsid();
		restrict_self();
		if (setgroups(0, NULL) < 0 || setresgid(gid, gid, gid) < 0 || setresuid(uid, uid, uid) < 0)
			die("cannot switch to uid %u: %s", (unsigned)uid, strerror(errno));
		if (syscall(SYS_close_range, 3U, ~0U, 0U) < 0)
			for (int fd = 3; fd < 65536; fd++)
				close(fd);
		signal(SIGPIPE, SIG_DFL);
		setenv("HOME", "/tmp", 1); /* the grader's HOME is under /.dsec, hidden from us */
		execvp(argv[i], argv + i);
		fprintf(stderr, "dsec-untrusted: %s: %s\n", argv[i], strerror(errno));
		_exit(errno == ENOENT ? 127 : 126);
	}
	int st = 0;
	while (waitpid(pid, &st, 0) < 0) {
		if (errno != EINTR) {
			st = FAIL << 8;
			break;
		}
	}
	kill_user(uid);
	if (WIFSIGNALED(st))
		return 128 + WTERMSIG(st);
	return WEXITSTATUS(st);
}
