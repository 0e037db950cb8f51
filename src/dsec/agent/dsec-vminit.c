/*
 * dsec-vminit: pid 1 of a DSec microVM guest, /init of the initramfs dsec.guest.initramfs
 * builds.
 *
 * Why a separate program and not dsec-init itself: the agent must stay the unchanged
 * container agent (one protocol, one implementation), while a VM first has to build the
 * sandbox's root from its drives and bridge the agent's unix socket to the host over the
 * single virtio-serial port. So this program does the boot, forks the bridge ("mux"), and
 * then becomes the agent:
 *
 *   1. mount devtmpfs/proc/sysfs, load the phase-0 modules of /modules.list (virtio,
 *      virtio_mmio, virtio_console) with finit_module;
 *   2. create the agent's LISTENING socket at /.dsec-agent.sock in the initramfs root and
 *      fork the mux, which stays in that root (after the root switch the path is
 *      unreachable to every guest process but the mux; no abstract socket, so an
 *      unprivileged guest user cannot connect to the agent);
 *   3. with dsec.wait=1 (template mode) wait for the host's GO, which carries the boot
 *      parameters, BEFORE any drive or network card is probed, so a snapshot taken while
 *      waiting can be restored with other drives attached;
 *   4. load the phase-1 modules (virtio_blk, virtio_net, erofs, overlay), find drives by
 *      /sys/block/vd* /serial (dsec-l0 = top layer ... dsec-rw), mount the layers (erofs,
 *      read-only), the writable ext4 disk (upper/ and work/ on it, created on first boot,
 *      kept across reboots and resumes) or a tmpfs, and the overlay on /newroot;
 *   5. loopback up, eth0 address and default route when dsec.ip is given (and
 *      /etc/resolv.conf naming the gateway, bound read-only), hostname;
 *   6. switch_root semantics: MS_MOVE /newroot onto /, chroot; the initramfs's files are
 *      deleted first (only the socket stays, held by the mux's root);
 *   7. exec the agent from an fd opened before the switch (execveat AT_EMPTY_PATH), with
 *      fd 3 the listening socket, env PATH and DSEC_AGENT_FD=3, as the container
 *      backend starts it. The agent binary never needs to exist in the image.
 *
 * Verifier mode (dsec.verify=1, the trusted verify step: src/dsec/backends/microvm/
 * verify.py): the layers are the sandbox's PRISTINE ones over a tmpfs upper (dsec.rw=0),
 * and between steps 4 and 5 (see setup_verifier):
 *   - a tmpfs at /.dsec: untrusted (copied from /dsec-untrusted), verify/hidden (the
 *     protected paths, for dsec-untrusted's Landlock rules), verify/refused (what of the
 *     graded trees is not shown, and why), verify/error (why the agent's disk could not
 *     be read: the host then fails the step closed), result/ and home/ (0700);
 *   - drive dsec-p<i> (EROFS) read-only at the i-th path of dsec.protected=/a,/b;
 *   - drive dsec-agent (a copy-on-write view of the agent's ext4 disk: its journal may
 *     be replayed, the real disk is never written) mounted read-only in the INITRAMFS
 *     root (/mnt/agent: unreachable after the root switch); for each path of
 *     dsec.graded=/a,/b its upper/<path> is walked component by component without
 *     following anything (a symlink, file or device where a directory should be is
 *     refused and the path shown empty; a whiteout shows it empty: the agent deleted
 *     it; an opaque directory hides the pristine content below it), then shown at
 *     /<path> as a READ-ONLY overlay over the pristine content there, with
 *     redirect_dir=nofollow,metacopy=off,index=off (no trusted.overlay.* xattr the agent
 *     crafted redirects a lookup, except whiteout/opaque, which are its deletions) and
 *     nosuid,nodev,nosymfollow: no symlink the agent planted in a graded tree is ever
 *     followed (readlink still shows it); a bounded walk lists in verify/refused the
 *     links leaving the tree, FIFOs and sockets (walk_graded).
 *
 * Any failure prints one "dsec-vminit: ..." line on the console (ttyS0) and restarts the
 * machine, which QEMU (-no-reboot) turns into its exit: the host sees QEMU end and reports
 * the console tail.
 *
 * The mux: guest end of the agent channel. The wire format is documented in one place,
 * src/dsec/guest/channel.py; the constants below mirror it. Everything from the host is
 * parsed with bounds; a violation drops every channel and waits for the next RESET.
 * Hardening as in dsec-init: the mux is not dumpable and every fd it owns is O_CLOEXEC.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <net/if.h>
#include <net/route.h>
#include <netinet/in.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/reboot.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <sys/xattr.h>
#include <linux/openat2.h>
#include <time.h>
#include <unistd.h>

#define AGENT_SOCK "/.dsec-agent.sock"
#define SERVICE_DIR "/run/dsec-agent"
#define SERVICE_SOCK SERVICE_DIR "/agent.sock"
#define PORT_NAME "dsec.agent"
#define DEFAULT_PATH "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#define MAX_LAYERS 32
#define MAX_PATHS_TEXT 1024 /* one dsec.graded= or dsec.protected= value */
#define MAX_PROTECTED 8
#ifndef MS_NOSYMFOLLOW
#define MS_NOSYMFOLLOW 256
#endif
#define DEVICE_WAIT_MS 10000

/* wire format: see src/dsec/guest/channel.py */
#define HDR 9u
#define MAX_PAYLOAD 65536u
#define WINDOW (256u * 1024u)
#define MAX_GO 4096u
#define MAX_CHANNELS 1024
#define OUT_HIGH (1u << 20) /* stop reading agent sockets above this backlog to the host */
#define T_RESET 'R'
#define T_HELLO 'H'
#define T_GO 'G'
#define T_OPEN 'O'
#define T_DATA 'D'
#define T_CREDIT 'C'
#define T_EOF 'E'
#define T_CLOSE 'X'
#define RESET_MAGIC "DSECRSET"
#define HELLO_MAGIC "DSECHELO"
#define ST_WAITING 1
#define ST_READY 2
#define ST_BOOTING 3

/* ------------------------------------------------------------------------------------ */
/* failure                                                                              */

static int g_service; /* --service: a full VM's system service, not pid 1 (see service_main) */

static void __attribute__((noreturn, format(printf, 1, 2))) die(const char *fmt, ...)
{
	char msg[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	dprintf(2, "dsec-vminit: %s\n", msg);
	if (g_service)
		_exit(1); /* a service's failure is its own, never the machine's */
	sync();
	reboot(RB_AUTOBOOT); /* QEMU runs with -no-reboot: this ends it */
	_exit(1);
}

static void warn_line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void warn_line(const char *fmt, ...)
{
	char msg[512];
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(msg, sizeof msg, fmt, ap);
	va_end(ap);
	dprintf(2, "dsec-vminit: %s\n", msg);
}

static void sleep_ms(int ms)
{
	struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
	nanosleep(&ts, NULL);
}

static void mkdir_p(const char *path, mode_t mode)
{
	char buf[256];
	snprintf(buf, sizeof buf, "%s", path);
	for (char *p = buf + 1; *p; p++) {
		if (*p == '/') {
			*p = 0;
			mkdir(buf, 0755);
			*p = '/';
		}
	}
	if (mkdir(buf, mode) < 0 && errno != EEXIST)
		die("mkdir %s: %s", path, strerror(errno));
}

static void do_mount(const char *src, const char *dst, const char *type, unsigned long flags,
		     const char *data)
{
	if (mount(src, dst, type, flags, data) < 0)
		die("mount %s (%s) on %s: %s", src, type, dst, strerror(errno));
}

static ssize_t read_small(const char *path, char *buf, size_t size)
{
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return -1;
	ssize_t n = read(fd, buf, size - 1);
	close(fd);
	if (n < 0)
		return -1;
	buf[n] = 0;
	while (n > 0 && (buf[n - 1] == '\n' || buf[n - 1] == ' '))
		buf[--n] = 0;
	return n;
}

/* ------------------------------------------------------------------------------------ */
/* boot parameters (kernel command line, or the host's GO in template mode)            */

struct params {
	int layers;
	int rw;
	int wait;
	char ip[20];
	int prefix;
	char gw[20];
	char hostname[65];
	long long time_us; /* the host's clock at GO (0: keep the guest's) */
	int verify;        /* a verifier VM (see the header) */
	int pack;          /* a packer VM: a verifier that writes the agent's changes (pack mode) */
	char graded[MAX_PATHS_TEXT + 1];
	char protected[MAX_PATHS_TEXT + 1];
};

/* "/a,/b": absolute, normalised, printable, no ':' or '\\' (overlay options). */
static int valid_path_list(const char *s)
{
	if (!*s || strlen(s) > MAX_PATHS_TEXT)
		return 0;
	const char *item = s;
	for (;;) {
		const char *end = strchr(item, ',');
		size_t n = end ? (size_t)(end - item) : strlen(item);
		if (n < 2 || item[0] != '/' || item[n - 1] == '/')
			return 0;
		for (size_t i = 0; i < n; i++) {
			char c = item[i];
			if (c <= ' ' || c > '~' || c == ':' || c == '\\')
				return 0;
			if (c == '/' && (item[i + 1] == '/' ||
					 (item[i + 1] == '.' && (i + 2 >= n || item[i + 2] == '/')) ||
					 (item[i + 1] == '.' && item[i + 2] == '.' &&
					  (i + 3 >= n || item[i + 3] == '/'))))
				return 0;
		}
		if (!end)
			return 1;
		item = end + 1;
	}
}

static int valid_hostname(const char *s)
{
	if (!*s || strlen(s) > 64)
		return 0;
	for (; *s; s++)
		if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
		      *s == '-' || *s == '.'))
			return 0;
	return 1;
}

static int valid_ipv4(const char *s)
{
	struct in_addr a;
	return strlen(s) < 16 && inet_pton(AF_INET, s, &a) == 1;
}

/* Parse "key=value ..." (only dsec.* keys; others are the kernel's). 0, or -1 with why. */
static int parse_params(const char *text, struct params *p, char *why, size_t whylen)
{
	char buf[MAX_GO + 1];
	snprintf(buf, sizeof buf, "%s", text);
	char *save = NULL;
	for (char *tok = strtok_r(buf, " \t\n", &save); tok; tok = strtok_r(NULL, " \t\n", &save)) {
		if (strncmp(tok, "dsec.", 5))
			continue;
		char *key = tok + 5, *val = strchr(key, '=');
		if (!val) {
			snprintf(why, whylen, "boot parameter %.40s has no value", tok);
			return -1;
		}
		*val++ = 0;
		char *end = NULL;
		if (!strcmp(key, "layers")) {
			long n = strtol(val, &end, 10);
			if (*end || end == val || n < 0 || n > MAX_LAYERS)
				goto bad;
			p->layers = (int)n;
		} else if (!strcmp(key, "rw") || !strcmp(key, "wait") || !strcmp(key, "verify") ||
			   !strcmp(key, "pack")) {
			if (strcmp(val, "0") && strcmp(val, "1"))
				goto bad;
			*(!strcmp(key, "rw")     ? &p->rw
			  : !strcmp(key, "wait") ? &p->wait
			  : !strcmp(key, "pack") ? &p->pack
						 : &p->verify) = val[0] == '1';
		} else if (!strcmp(key, "graded") || !strcmp(key, "protected")) {
			if (!valid_path_list(val))
				goto bad;
			snprintf(!strcmp(key, "graded") ? p->graded : p->protected, MAX_PATHS_TEXT + 1,
				 "%s", val);
		} else if (!strcmp(key, "ip")) {
			char *slash = strchr(val, '/');
			if (!slash)
				goto bad;
			*slash = 0;
			long n = strtol(slash + 1, &end, 10);
			if (*end || end == slash + 1 || n < 1 || n > 32 || !valid_ipv4(val))
				goto bad;
			snprintf(p->ip, sizeof p->ip, "%s", val);
			p->prefix = (int)n;
		} else if (!strcmp(key, "gw")) {
			if (!valid_ipv4(val))
				goto bad;
			snprintf(p->gw, sizeof p->gw, "%s", val);
		} else if (!strcmp(key, "hostname")) {
			if (!valid_hostname(val))
				goto bad;
			snprintf(p->hostname, sizeof p->hostname, "%s", val);
		} else if (!strcmp(key, "time")) {
			/* microseconds since the epoch: a guest restored from a snapshot would
			 * otherwise run on the time the snapshot was taken */
			long long t = strtoll(val, &end, 10);
			if (*end || end == val || t <= 0)
				goto bad;
			p->time_us = t;
		} else {
			snprintf(why, whylen, "unknown boot parameter dsec.%.40s", key);
			return -1;
		}
		continue;
	bad:
		snprintf(why, whylen, "bad value for dsec.%.20s: %.60s", key, val);
		return -1;
	}
	return 0;
}

/* ------------------------------------------------------------------------------------ */
/* modules and devices                                                                  */

static void load_modules(int phase)
{
	FILE *f = fopen("/modules.list", "re");
	if (!f)
		die("cannot open /modules.list: %s", strerror(errno));
	char line[256];
	while (fgets(line, sizeof line, f)) {
		int ph;
		char name[200], path[256];
		if (sscanf(line, "%d %199s", &ph, name) != 2 || strchr(name, '/'))
			die("bad line in /modules.list: %.80s", line);
		if (ph != phase)
			continue;
		snprintf(path, sizeof path, "/modules/%s", name);
		int fd = open(path, O_RDONLY | O_CLOEXEC);
		if (fd < 0)
			die("open %s: %s", path, strerror(errno));
		if (syscall(SYS_finit_module, fd, "", 0) < 0 && errno != EEXIST)
			die("load module %s: %s", name, strerror(errno));
		close(fd);
		unlink(path); /* initramfs memory is freed as we go */
	}
	fclose(f);
}

/* /dev/vportNpM whose sysfs name is PORT_NAME, waiting for it to appear; -1 when it
 * never does. */
static int find_port(char *dev, size_t len)
{
	for (int waited = 0; waited < DEVICE_WAIT_MS; waited += 5) {
		DIR *d = opendir("/sys/class/virtio-ports");
		struct dirent *e;
		while (d && (e = readdir(d))) {
			char path[300], name[64];
			if (e->d_name[0] == '.')
				continue;
			snprintf(path, sizeof path, "/sys/class/virtio-ports/%s/name", e->d_name);
			if (read_small(path, name, sizeof name) >= 0 && !strcmp(name, PORT_NAME)) {
				snprintf(dev, len, "/dev/%s", e->d_name);
				closedir(d);
				if (access(dev, F_OK) == 0)
					return 0;
				d = NULL;
				break;
			}
		}
		if (d)
			closedir(d);
		sleep_ms(5);
	}
	return -1;
}

/* /dev/vdX whose /sys/block/vdX/serial is `serial`, or "" while it is missing. */
static void drive_by_serial(const char *serial, char *dev, size_t len)
{
	dev[0] = 0;
	DIR *d = opendir("/sys/block");
	struct dirent *e;
	while (d && (e = readdir(d))) {
		char path[300], got[64];
		if (strncmp(e->d_name, "vd", 2))
			continue;
		snprintf(path, sizeof path, "/sys/block/%s/serial", e->d_name);
		if (strlen(e->d_name) < 32 && read_small(path, got, sizeof got) >= 0 &&
		    !strcmp(got, serial)) {
			snprintf(dev, len, "/dev/%.32s", e->d_name);
			break;
		}
	}
	if (d)
		closedir(d);
}

static void wait_drive(const char *serial, char *dev, size_t len)
{
	for (int waited = 0; waited < DEVICE_WAIT_MS; waited += 5) {
		drive_by_serial(serial, dev, len);
		if (dev[0] && access(dev, F_OK) == 0)
			return;
		sleep_ms(5);
	}
	die("no drive with serial %s (virtio-blk-device,serial=%s)", serial, serial);
}

/* ------------------------------------------------------------------------------------ */
/* network                                                                              */

static void set_addr(struct sockaddr *sa, const char *ip)
{
	struct sockaddr_in *in = (struct sockaddr_in *)sa;
	memset(in, 0, sizeof *in);
	in->sin_family = AF_INET;
	inet_pton(AF_INET, ip, &in->sin_addr);
}

static void if_up(int s, const char *name)
{
	struct ifreq ifr;
	memset(&ifr, 0, sizeof ifr);
	snprintf(ifr.ifr_name, IFNAMSIZ, "%s", name);
	if (ioctl(s, SIOCGIFFLAGS, &ifr) < 0)
		die("%s: SIOCGIFFLAGS: %s", name, strerror(errno));
	ifr.ifr_flags |= IFF_UP | IFF_RUNNING;
	if (ioctl(s, SIOCSIFFLAGS, &ifr) < 0)
		die("%s: bring up: %s", name, strerror(errno));
}

static void setup_network(const struct params *p)
{
	int s = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
	if (s < 0)
		die("socket: %s", strerror(errno));
	if_up(s, "lo"); /* the kernel gives lo 127.0.0.1/8 when it comes up */
	if (p->ip[0]) {
		for (int waited = 0; access("/sys/class/net/eth0", F_OK); waited += 5) {
			if (waited >= DEVICE_WAIT_MS)
				die("dsec.ip is set but there is no eth0 (virtio-net-device)");
			sleep_ms(5);
		}
		struct ifreq ifr;
		memset(&ifr, 0, sizeof ifr);
		snprintf(ifr.ifr_name, IFNAMSIZ, "eth0");
		set_addr(&ifr.ifr_addr, p->ip);
		if (ioctl(s, SIOCSIFADDR, &ifr) < 0)
			die("eth0: set address %s: %s", p->ip, strerror(errno));
		uint32_t mask = p->prefix == 32 ? 0xffffffffu : ~(0xffffffffu >> p->prefix);
		struct sockaddr_in *m = (struct sockaddr_in *)&ifr.ifr_netmask;
		memset(m, 0, sizeof *m);
		m->sin_family = AF_INET;
		m->sin_addr.s_addr = htonl(mask);
		if (ioctl(s, SIOCSIFNETMASK, &ifr) < 0)
			die("eth0: set netmask /%d: %s", p->prefix, strerror(errno));
		if_up(s, "eth0");
		if (p->gw[0]) {
			struct rtentry rt;
			memset(&rt, 0, sizeof rt);
			set_addr(&rt.rt_dst, "0.0.0.0");
			set_addr(&rt.rt_genmask, "0.0.0.0");
			set_addr(&rt.rt_gateway, p->gw);
			rt.rt_flags = RTF_UP | RTF_GATEWAY;
			rt.rt_dev = (char *)"eth0";
			if (ioctl(s, SIOCADDRT, &rt) < 0)
				die("eth0: default route via %s: %s", p->gw, strerror(errno));
		}
	}
	close(s);
}

/* /etc/resolv.conf naming the gateway, where the edge's DNS responder answers (as the
 * container backend bind-mounts it): without it the image's resolver asks 127.0.0.1 and
 * a guest with network rules resolves nothing. A read-only bind of a file kept in the
 * initramfs root, so the image's own file is untouched and pack_diff does not see it. */
static void setup_resolv(const struct params *p)
{
	static const char *target = "/newroot/etc/resolv.conf";
	if (!p->gw[0])
		return;
	int fd = open("/resolv.conf", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0 || dprintf(fd, "nameserver %s\n", p->gw) < 0)
		die("write /resolv.conf: %s", strerror(errno));
	close(fd);
	mkdir_p("/newroot/etc", 0755);
	struct stat st;
	if (lstat(target, &st) == 0 && !S_ISREG(st.st_mode) && unlink(target) < 0)
		die("replace %s: %s", target, strerror(errno));
	fd = open(target, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0644);
	if (fd < 0)
		die("create %s: %s", target, strerror(errno));
	close(fd);
	do_mount("/resolv.conf", target, NULL, MS_BIND, NULL);
	do_mount(NULL, target, NULL, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC,
		 NULL);
}

/* ------------------------------------------------------------------------------------ */
/* the mux (guest end of the agent channel)                                            */

struct buf {
	unsigned char *p;
	size_t len, cap;
};

static void buf_put(struct buf *b, const void *data, size_t n)
{
	if (b->len + n > b->cap) {
		size_t cap = b->cap ? b->cap : 65536;
		while (cap < b->len + n)
			cap *= 2;
		unsigned char *np = realloc(b->p, cap);
		if (!np)
			die("mux: out of memory");
		b->p = np;
		b->cap = cap;
	}
	memcpy(b->p + b->len, data, n);
	b->len += n;
}

static void buf_drop(struct buf *b, size_t n)
{
	memmove(b->p, b->p + n, b->len - n);
	b->len -= n;
	if (b->len == 0 && b->cap > 4 * 65536) {
		free(b->p);
		b->p = NULL;
		b->cap = 0;
	}
}

struct chan {
	uint32_t id;
	int fd;
	uint32_t credit;    /* bytes we may still send the host on this channel */
	struct buf to_agent; /* received from the host, not yet written to the agent */
	int host_eof, agent_eof, shut_wr;
};

static struct chan g_ch[MAX_CHANNELS];
static int g_nch;
static int g_vfd = -1;
static struct buf g_out;   /* frames to the host */
static unsigned char g_in[HDR + MAX_PAYLOAD];
static size_t g_inlen;
static int g_synced;       /* a RESET was seen since the link (re)started */
static unsigned char g_nonce[8];
static uint32_t g_last_id; /* highest channel id the host opened since its RESET */
static int g_state = ST_BOOTING;
static int g_go_fd = -1;   /* template mode: where the GO parameters go to pid 1 */
static const char *g_agent_sock = AGENT_SOCK; /* SERVICE_SOCK in service mode */

static void put_le32(unsigned char *p, uint32_t v)
{
	for (int i = 0; i < 4; i++)
		p[i] = (unsigned char)(v >> (8 * i));
}

static uint32_t get_le32(const unsigned char *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static void send_frame(int type, uint32_t id, const void *data, uint32_t n)
{
	unsigned char h[HDR];
	h[0] = (unsigned char)type;
	put_le32(h + 1, id);
	put_le32(h + 5, n);
	buf_put(&g_out, h, HDR);
	if (n)
		buf_put(&g_out, data, n);
}

static void send_hello(void)
{
	unsigned char p[17];
	memcpy(p, HELLO_MAGIC, 8);
	memcpy(p + 8, g_nonce, 8);
	p[16] = (unsigned char)g_state;
	send_frame(T_HELLO, 0, p, sizeof p);
}

static struct chan *chan_find(uint32_t id)
{
	for (int i = 0; i < g_nch; i++)
		if (g_ch[i].id == id)
			return &g_ch[i];
	return NULL;
}

/* Forget a channel; tell the host unless it told us. */
static void chan_close(struct chan *c, int tell)
{
	if (tell)
		send_frame(T_CLOSE, c->id, NULL, 0);
	close(c->fd);
	free(c->to_agent.p);
	*c = g_ch[--g_nch];
	memset(&g_ch[g_nch], 0, sizeof g_ch[g_nch]);
}

static void drop_all_channels(void)
{
	while (g_nch)
		chan_close(&g_ch[0], 0);
}

/* The host broke the protocol: drop every channel, keep parsing (parse_input hunts for
 * the next RESET in what follows). */
static void violation(const char *what)
{
	warn_line("agent channel: protocol violation (%s); waiting for the host's RESET", what);
	drop_all_channels();
	g_synced = 0;
	g_last_id = 0;
}

static void chan_open(uint32_t id)
{
	if (g_nch == MAX_CHANNELS) {
		send_frame(T_CLOSE, id, NULL, 0);
		return;
	}
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	struct sockaddr_un sun = {.sun_family = AF_UNIX};
	snprintf(sun.sun_path, sizeof sun.sun_path, "%s", g_agent_sock);
	if (fd < 0 || connect(fd, (struct sockaddr *)&sun, sizeof sun) < 0) {
		warn_line("agent channel: connect to the agent: %s", strerror(errno));
		if (fd >= 0)
			close(fd);
		send_frame(T_CLOSE, id, NULL, 0);
		return;
	}
	struct chan *c = &g_ch[g_nch++];
	memset(c, 0, sizeof *c);
	c->id = id;
	c->fd = fd;
	c->credit = WINDOW;
}

/* Write what we hold for the agent; returns 0, or -1 when the channel was closed. */
static int chan_flush(struct chan *c)
{
	if (c->to_agent.len) {
		ssize_t n = write(c->fd, c->to_agent.p, c->to_agent.len);
		if (n < 0 && (errno == EAGAIN || errno == EINTR))
			return 0;
		if (n < 0) {
			chan_close(c, 1);
			return -1;
		}
		unsigned char cr[4];
		put_le32(cr, (uint32_t)n);
		send_frame(T_CREDIT, c->id, cr, 4);
		buf_drop(&c->to_agent, (size_t)n);
	}
	if (!c->to_agent.len && c->host_eof && !c->shut_wr) {
		shutdown(c->fd, SHUT_WR);
		c->shut_wr = 1;
	}
	if (c->shut_wr && c->agent_eof) {
		chan_close(c, 1);
		return -1;
	}
	return 0;
}

static void chan_read(struct chan *c)
{
	static unsigned char tmp[MAX_PAYLOAD];
	size_t want = c->credit < MAX_PAYLOAD ? c->credit : MAX_PAYLOAD;
	ssize_t n = read(c->fd, tmp, want);
	if (n < 0 && (errno == EAGAIN || errno == EINTR))
		return;
	if (n < 0) {
		chan_close(c, 1);
		return;
	}
	if (n == 0) {
		c->agent_eof = 1;
		send_frame(T_EOF, c->id, NULL, 0);
		chan_flush(c);
		return;
	}
	send_frame(T_DATA, c->id, tmp, (uint32_t)n);
	c->credit -= (uint32_t)n;
}

/* One complete frame from the host (after RESET). */
static void on_frame(int type, uint32_t id, const unsigned char *p, uint32_t n)
{
	struct chan *c;
	switch (type) {
	case T_RESET:
		if (id || n != 16 || memcmp(p, RESET_MAGIC, 8))
			return violation("bad RESET");
		drop_all_channels();
		g_last_id = 0;
		memcpy(g_nonce, p + 8, 8);
		send_hello();
		return;
	case T_GO:
		if (id || n > MAX_GO)
			return violation("bad GO");
		if (g_go_fd >= 0) {
			char text[MAX_GO + 1];
			memcpy(text, p, n);
			text[n] = 0;
			if (strlen(text) != n)
				return violation("GO has a NUL byte");
			if (write(g_go_fd, text, n + 1) < 0)
				warn_line("GO: %s", strerror(errno));
			close(g_go_fd);
			g_go_fd = -1;
			g_state = ST_BOOTING;
			send_hello();
		}
		return;
	case T_OPEN:
		if (!id || id <= g_last_id || n)
			return violation("bad OPEN");
		g_last_id = id;
		chan_open(id);
		return;
	case T_DATA:
	case T_CREDIT:
	case T_EOF:
	case T_CLOSE:
		if (!id || id > g_last_id)
			return violation("frame for a channel never opened");
		c = chan_find(id);
		if (type == T_DATA && (n == 0 || (c && (c->host_eof || c->to_agent.len + n > WINDOW))))
			return violation("DATA past the window or after EOF");
		if ((type == T_CREDIT && n != 4) || ((type == T_EOF || type == T_CLOSE) && n))
			return violation("bad frame length");
		if (!c)
			return; /* a channel we closed meanwhile */
		if (type == T_DATA) {
			buf_put(&c->to_agent, p, n);
			chan_flush(c);
		} else if (type == T_CREDIT) {
			uint32_t v = get_le32(p);
			if (v > WINDOW || c->credit + v > WINDOW)
				return violation("CREDIT past the window");
			c->credit += v;
		} else if (type == T_EOF) {
			if (c->host_eof)
				return violation("second EOF");
			c->host_eof = 1;
			chan_flush(c);
		} else {
			chan_close(c, 0);
		}
		return;
	default:
		return violation("unknown frame type");
	}
}

/* Frames in g_in; a violation (g_synced drops to 0) hunts for the next RESET in the
 * bytes that follow it, so the buffer is walked once and never reset under our feet. */
static void parse_input(void)
{
	static const unsigned char pat[HDR + 8] = {T_RESET, 0, 0, 0, 0, 16, 0, 0, 0,
						  'D', 'S', 'E', 'C', 'R', 'S', 'E', 'T'};
	size_t off = 0;
	for (;;) {
		if (!g_synced) { /* whatever came before RESET is an older host's */
			unsigned char *hit = memmem(g_in + off, g_inlen - off, pat, sizeof pat);
			if (!hit) {
				size_t left = g_inlen - off, keep = sizeof pat - 1;
				off += left > keep ? left - keep : 0;
				break;
			}
			off = (size_t)(hit - g_in);
			g_synced = 1;
		}
		if (off < g_inlen && g_in[off] == 0) {
			/* The host's connect preamble: a new host process, whose RESET follows.
			 * We may not have seen the old one go (a quick reconnect), so this is
			 * where the old link ends. */
			drop_all_channels();
			g_synced = 0;
			g_last_id = 0;
			continue;
		}
		if (g_inlen - off < HDR)
			break;
		const unsigned char *h = g_in + off;
		uint32_t id = get_le32(h + 1), n = get_le32(h + 5);
		if (n > MAX_PAYLOAD) {
			violation("frame longer than the maximum");
			continue;
		}
		if (g_inlen - off < HDR + n)
			break;
		off += HDR + n;
		on_frame(h[0], id, h + HDR, n);
	}
	memmove(g_in, g_in + off, g_inlen - off);
	g_inlen -= off;
}

static void mux_main(const char *port, int exec_fd, int go_fd)
{
	prctl(PR_SET_DUMPABLE, 0);
	prctl(PR_SET_NAME, "dsec-vmmux");
	signal(SIGPIPE, SIG_IGN);
	g_go_fd = go_fd;
	g_state = go_fd >= 0 ? ST_WAITING : ST_BOOTING;
	g_vfd = open(port, O_RDWR | O_NONBLOCK | O_CLOEXEC);
	if (g_vfd < 0)
		die("open %s: %s", port, strerror(errno));
	int host_up = 1;
	struct pollfd pfd[MAX_CHANNELS + 2];
	uint32_t ids[MAX_CHANNELS];
	for (;;) {
		int np = 0;
		pfd[np++] = (struct pollfd){.fd = exec_fd, .events = POLLIN};
		pfd[np++] = (struct pollfd){.fd = host_up ? g_vfd : -1,
					    .events = (short)(POLLIN | (g_out.len ? POLLOUT : 0))};
		for (int i = 0; i < g_nch; i++) {
			struct chan *c = &g_ch[i];
			short ev = 0;
			if (!c->agent_eof && c->credit && g_out.len < OUT_HIGH)
				ev |= POLLIN;
			if (c->to_agent.len)
				ev |= POLLOUT;
			ids[i] = c->id;
			pfd[np++] = (struct pollfd){.fd = ev ? c->fd : -1, .events = ev};
		}
		if (poll(pfd, (nfds_t)np, host_up ? -1 : 50) < 0) {
			if (errno != EINTR)
				die("mux: poll: %s", strerror(errno));
			continue;
		}
		if (pfd[0].revents) {
			int err = 0;
			ssize_t n = read(exec_fd, &err, sizeof err);
			if (n <= 0) { /* closed by a successful exec: the agent runs */
				close(exec_fd);
				exec_fd = -1;
				g_state = ST_READY;
				if (g_synced)
					send_hello();
			}
		}
		if (!host_up) {
			/* The host end was closed; POLLHUP would be reported without pause, so look
			 * again every 50 ms until a host process connects. */
			struct pollfd v = {.fd = g_vfd, .events = POLLIN};
			if (poll(&v, 1, 0) == 1 && (v.revents & POLLHUP) && !(v.revents & POLLIN))
				continue;
			host_up = 1;
			continue;
		}
		short vre = pfd[1].revents;
		if (vre & (POLLIN | POLLHUP | POLLERR)) {
			ssize_t n = read(g_vfd, g_in + g_inlen, sizeof g_in - g_inlen);
			if (n > 0) {
				g_inlen += (size_t)n;
				parse_input();
			} else if (n == 0 || (errno != EAGAIN && errno != EINTR)) {
				/* The host end is closed as this guest sees it. That is no reason to
				 * forget anything: the port's state reaches the guest on the control
				 * queue and the next host's bytes on the port's own, handled apart,
				 * so after a restore the new host's RESET can be read before this
				 * EOF of the old one. Ending the link here threw away the HELLO that
				 * answered it, and the host, whose RESET was taken, waited for ever.
				 * Only the next host's PREAMBLE and RESET end a link (parse_input);
				 * until the port shows a host again, stop reading it. */
				host_up = 0;
				continue;
			}
		}
		if (g_out.len) {
			ssize_t n = write(g_vfd, g_out.p, g_out.len);
			if (n > 0)
				buf_drop(&g_out, (size_t)n);
		}
		for (int i = 2; i < np; i++) {
			short re = pfd[i].revents;
			if (!re)
				continue;
			struct chan *c = chan_find(ids[i - 2]);
			if (!c)
				continue;
			if (re & POLLOUT) {
				if (chan_flush(c) < 0)
					continue;
			}
			if (re & (POLLIN | POLLHUP | POLLERR)) {
				if (pfd[i].events & POLLIN)
					chan_read(c);
				else if (!(re & POLLOUT))
					chan_close(c, 1);
			}
		}
	}
}

/* ------------------------------------------------------------------------------------ */
/* pid 1                                                                                */

static void setup_verifier(const struct params *p);

static void mount_root(const struct params *p)
{
	char dev[64], serial[32], dir[32], lower[MAX_LAYERS * 12 + 16];
	if (p->layers < 1)
		die("dsec.layers must be at least 1 (the image's layers), not %d", p->layers);
	if (p->verify && p->rw)
		die("a verifier has no writable disk of its own (dsec.verify=1 needs dsec.rw=0)");
	if (!p->verify && (p->graded[0] || p->protected[0] || p->pack))
		die("dsec.graded, dsec.protected and dsec.pack need dsec.verify=1");
	lower[0] = 0;
	for (int i = 0; i < p->layers; i++) {
		snprintf(serial, sizeof serial, "dsec-l%d", i);
		snprintf(dir, sizeof dir, "/mnt/l%d", i);
		wait_drive(serial, dev, sizeof dev);
		mkdir_p(dir, 0755);
		do_mount(dev, dir, "erofs", MS_RDONLY, NULL);
		snprintf(lower + strlen(lower), sizeof lower - strlen(lower), "%s%s", i ? ":" : "", dir);
	}
	mkdir_p("/mnt/rw", 0755);
	if (p->rw) {
		wait_drive("dsec-rw", dev, sizeof dev);
		do_mount(dev, "/mnt/rw", "ext4", MS_NOATIME, NULL);
	} else {
		do_mount("tmpfs", "/mnt/rw", "tmpfs", 0, "mode=0755");
	}
	mkdir_p("/mnt/rw/upper", 0755); /* a rebooted or resumed disk keeps its upper */
	mkdir_p("/mnt/rw/work", 0700);
	char opts[sizeof lower + 80];
	snprintf(opts, sizeof opts, "lowerdir=%s,upperdir=/mnt/rw/upper,workdir=/mnt/rw/work", lower);
	mkdir_p("/newroot", 0755);
	do_mount("overlay", "/newroot", "overlay", 0, opts);

	const unsigned long nse = MS_NOSUID | MS_NOEXEC | MS_NODEV;
	mkdir_p("/newroot/proc", 0555);
	mkdir_p("/newroot/sys", 0555);
	mkdir_p("/newroot/dev", 0755);
	do_mount("proc", "/newroot/proc", "proc", nse, NULL);
	do_mount("sysfs", "/newroot/sys", "sysfs", nse, NULL);
	do_mount("devtmpfs", "/newroot/dev", "devtmpfs", MS_NOSUID, "mode=0755");
	mkdir_p("/newroot/dev/pts", 0755);
	do_mount("devpts", "/newroot/dev/pts", "devpts", MS_NOSUID | MS_NOEXEC,
		 "newinstance,ptmxmode=0666,mode=0620,gid=5");
	if (p->verify)
		setup_verifier(p);
	unlink("/newroot/dev/ptmx");
	if (symlink("pts/ptmx", "/newroot/dev/ptmx") < 0)
		die("symlink /dev/ptmx: %s", strerror(errno));
	mkdir_p("/newroot/dev/shm", 01777);
	do_mount("shm", "/newroot/dev/shm", "tmpfs", nse, "mode=1777");
}

/* ------------------------------------------------------------------------------------ */
/* verifier mode (see the header)                                                       */

#define VERIFY_DIR "/newroot/.dsec"
#define AGENT_MNT "/mnt/agent"
#define EMPTY_DIR "/mnt/empty"


static int g_report = -1; /* /.dsec/verify/refused */

static void write_file(const char *path, mode_t mode, const void *data, size_t n)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, mode);
	if (fd < 0 || (n && write(fd, data, n) != (ssize_t)n))
		die("write %s: %s", path, strerror(errno));
	close(fd);
}

static void copy_file(const char *from, const char *to, mode_t mode)
{
	int in = open(from, O_RDONLY | O_CLOEXEC);
	if (in < 0)
		die("open %s: %s", from, strerror(errno));
	int out = open(to, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, mode);
	if (out < 0)
		die("create %s: %s", to, strerror(errno));
	char buf[65536];
	ssize_t n;
	while ((n = read(in, buf, sizeof buf)) > 0)
		if (write(out, buf, (size_t)n) != n)
			die("write %s: %s", to, strerror(errno));
	if (n < 0)
		die("read %s: %s", from, strerror(errno));
	close(in);
	close(out);
}

static void refuse(const char *path, const char *why)
{
	warn_line("verify: graded %s not shown: %s", path, why);
	if (g_report >= 0)
		dprintf(g_report, "%s\t%s\n", path, why);
}

/* The i-th item of "/a,/b" into out (1), or 0 past the end. */
static int nth_path(const char *list, int i, char *out, size_t len)
{
	const char *item = list;
	for (int k = 0; *item; k++) {
		const char *end = strchr(item, ',');
		size_t n = end ? (size_t)(end - item) : strlen(item);
		if (k == i) {
			if (n >= len)
				die("path too long in %.60s", list);
			memcpy(out, item, n);
			out[n] = 0;
			return 1;
		}
		if (!end)
			break;
		item = end + 1;
	}
	return 0;
}

/* A directory at /newroot<path> in the verifier's own (pristine + tmpfs) tree, reached
 * without following a symlink (the pristine image is trusted, but a link there would
 * put the mount somewhere else): an fd, or -1. */
static int newroot_dir(const char *path)
{
	int root = open("/newroot", O_PATH | O_DIRECTORY | O_CLOEXEC);
	if (root < 0)
		die("open /newroot: %s", strerror(errno));
	char buf[MAX_PATHS_TEXT + 1];
	snprintf(buf, sizeof buf, "%s", path + 1);
	int cur = root;
	char *save = NULL;
	for (char *c = strtok_r(buf, "/", &save); c; c = strtok_r(NULL, "/", &save)) {
		if (mkdirat(cur, c, 0755) < 0 && errno != EEXIST)
			break;
		int next = openat(cur, c, O_PATH | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
		close(cur);
		cur = next;
		if (cur < 0)
			return -1;
	}
	return cur;
}

static void mount_empty(const char *path, const char *why)
{
	refuse(path, why);
	char dst[MAX_PATHS_TEXT + 16];
	snprintf(dst, sizeof dst, "/newroot%s", path);
	int fd = newroot_dir(path);
	if (fd < 0)
		die("verify: cannot make %s", dst);
	close(fd);
	do_mount("tmpfs", dst, "tmpfs", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOEXEC, "mode=0755");
}

/* Report what of a graded tree the grader sees but cannot use as the container verifier
 * would (that one leaves such entries out): symbolic links leaving the tree (shown,
 * never followed: nosymfollow), FIFOs and sockets (an open of a FIFO blocks). Bounded:
 * depth and entries; whiteouts are deletions, not reported. */
#define WALK_MAX_ENTRIES 20000
#define WALK_MAX_DEPTH 64
static int g_walked;

static int link_escapes(const char *target, int depth)
{
	if (target[0] == '/')
		return 1;
	int level = depth; /* directories below the graded root we are in */
	char buf[PATH_MAX];
	snprintf(buf, sizeof buf, "%s", target);
	char *save = NULL;
	for (char *c = strtok_r(buf, "/", &save); c; c = strtok_r(NULL, "/", &save)) {
		if (!strcmp(c, ".."))
			level--;
		else if (strcmp(c, "."))
			level++;
		if (level < 0)
			return 1;
	}
	return 0;
}

static void walk_graded(int fd, char *path, size_t len, int depth)
{
	DIR *d = fdopendir(fd);
	if (!d) {
		close(fd);
		return;
	}
	struct dirent *e;
	while ((e = readdir(d))) {
		if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
			continue;
		if (++g_walked > WALK_MAX_ENTRIES)
			break;
		size_t n = strlen(e->d_name);
		if (len + 1 + n >= PATH_MAX)
			continue;
		path[len] = '/';
		memcpy(path + len + 1, e->d_name, n + 1);
		struct stat st;
		if (fstatat(dirfd(d), e->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
			if (S_ISLNK(st.st_mode)) {
				char target[PATH_MAX];
				ssize_t t = readlinkat(dirfd(d), e->d_name, target, sizeof target - 1);
				if (t >= 0) {
					target[t] = 0;
					if (link_escapes(target, depth))
						refuse(path, "a symbolic link leaving the graded tree (shown, "
							     "never followed)");
				}
			} else if (S_ISFIFO(st.st_mode)) {
				refuse(path, "a FIFO (shown: opening it blocks)");
			} else if (S_ISSOCK(st.st_mode)) {
				refuse(path, "a socket (shown, not connectable)");
			} else if (S_ISDIR(st.st_mode) && depth < WALK_MAX_DEPTH) {
				int sub = openat(dirfd(d), e->d_name,
						 O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
				if (sub >= 0)
					walk_graded(sub, path, len + 1 + n, depth + 1);
			}
		}
		path[len] = 0;
	}
	closedir(d);
}

/* Walk upper/<path> of the agent's disk without following anything (see the header)
 * and show it read-only over the pristine content at <path>. */
static void mount_graded(int upper, const char *path)
{
	char buf[MAX_PATHS_TEXT + 1];
	snprintf(buf, sizeof buf, "%s", path + 1);
	int cur = fcntl(upper, F_DUPFD_CLOEXEC, 3), over = 1;
	if (cur < 0)
		die("dup: %s", strerror(errno));
	char *save = NULL;
	for (char *c = strtok_r(buf, "/", &save); c; c = strtok_r(NULL, "/", &save)) {
		struct stat st;
		if (fstatat(cur, c, &st, AT_SYMLINK_NOFOLLOW) < 0) {
			close(cur);
			if (errno != ENOENT)
				return mount_empty(path, "unreadable in the agent's disk");
			if (over)
				return; /* the agent changed nothing there: the pristine content stays */
			return mount_empty(path, "deleted by the agent");
		}
		if (S_ISCHR(st.st_mode) && st.st_rdev == 0) {
			close(cur);
			return mount_empty(path, "deleted by the agent");
		}
		if (S_ISLNK(st.st_mode)) {
			close(cur);
			return mount_empty(path, "a symbolic link in the agent's disk (not followed)");
		}
		if (!S_ISDIR(st.st_mode)) {
			close(cur);
			return mount_empty(path, "not a directory in the agent's disk");
		}
		struct open_how how = {.flags = O_RDONLY | O_DIRECTORY | O_CLOEXEC,
				       .resolve = RESOLVE_NO_SYMLINKS | RESOLVE_BENEATH |
						  RESOLVE_NO_MAGICLINKS | RESOLVE_NO_XDEV};
		int next = (int)syscall(SYS_openat2, cur, c, &how, sizeof how);
		close(cur);
		if (next < 0)
			return mount_empty(path, "changed while it was opened (not followed)");
		cur = next;
		char v[4];
		ssize_t n = fgetxattr(cur, "trusted.overlay.opaque", v, sizeof v);
		if (n == 1 && v[0] == 'y')
			over = 0; /* the agent re-made this directory: nothing pristine below */
	}
	char dst[MAX_PATHS_TEXT + 16], opts[MAX_PATHS_TEXT + 200];
	snprintf(dst, sizeof dst, "/newroot%s", path);
	int target = newroot_dir(path);
	if (target < 0) {
		close(cur);
		return mount_empty(path, "no directory can be made there in the pristine image");
	}
	close(target);
	snprintf(opts, sizeof opts,
		 "lowerdir=/proc/self/fd/%d:%s,redirect_dir=nofollow,metacopy=off,index=off,xino=off",
		 cur, over ? dst : EMPTY_DIR);
	if (mount("overlay", dst, "overlay", MS_RDONLY | MS_NOSUID | MS_NODEV | MS_NOSYMFOLLOW,
		  opts) < 0) {
		int err = errno;
		close(cur);
		char why[120];
		snprintf(why, sizeof why, "cannot be shown (overlay: %s)", strerror(err));
		return mount_empty(path, why);
	}
	char walked[PATH_MAX];
	snprintf(walked, sizeof walked, "%s", path);
	walk_graded(cur, walked, strlen(walked), 0); /* closes cur */
}

/* ------------------------------------------------------------------------------------ */
/* pack mode (dsec.pack=1: src/dsec/backends/microvm/pack.py)                           */
/*
 * The agent's upper/ written as a tar (POSIX ustar, pax records for long names, big
 * sizes and ids) to drive dsec-out, in the OCI layer convention: a whiteout (char 0/0)
 * is an empty ".wh.<name>", an opaque directory (trusted.overlay.opaque=y) gets an
 * empty ".wh..wh..opq". Hard links within the upper are kept (by inode), sockets and
 * device nodes other than whiteouts are left out (counted), and no other xattr is
 * carried: the host trusts none of this (it parses the stream as hostile, see
 * dsec.images.difftar), the format only has to be what a correct upper looks like.
 * Nothing is followed: every entry is opened relative to its directory, O_NOFOLLOW.
 * The result is reported in verify/packed ("<entries> <bytes> <skipped>") or, when the
 * tar does not fit the drive or a read fails, in verify/error.
 */
#define PACK_STATUS VERIFY_DIR "/verify/packed"
#define PACK_MAX_DEPTH 512
#define PACK_LINKS 65536

static int g_pack_fd = -1;
static unsigned long long g_pack_pos, g_pack_cap, g_entries, g_skipped;
static int g_pack_failed;
static char g_pack_why[200];
static struct {
	dev_t dev;
	ino_t ino;
	char *name;
} g_links[PACK_LINKS];
static size_t g_nlinks;

static void pack_fail(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void pack_fail(const char *fmt, ...)
{
	if (g_pack_failed++)
		return;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(g_pack_why, sizeof g_pack_why, fmt, ap);
	va_end(ap);
}

static void out_write(const void *buf, size_t n)
{
	if (g_pack_failed)
		return;
	if (n > g_pack_cap - g_pack_pos) {
		pack_fail("the changes do not fit the pack drive (%llu bytes)", g_pack_cap);
		return;
	}
	const char *b = buf;
	while (n) {
		ssize_t w = write(g_pack_fd, b, n);
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0) {
			pack_fail("write the pack drive: %s", strerror(errno));
			return;
		}
		b += w;
		n -= (size_t)w;
		g_pack_pos += (unsigned long long)w;
	}
}

static void out_pad(unsigned long long size)
{
	static const char zero[512];
	if (size % 512)
		out_write(zero, 512 - size % 512);
}

/* One pax record "<len> key=value\n", its length counting its own digits. */
static size_t pax_record(char *buf, size_t cap, size_t at, const char *key, const char *val)
{
	size_t body = 1 + strlen(key) + 1 + strlen(val) + 1, len = body + 1;
	while ((size_t)snprintf(NULL, 0, "%zu", len) + body != len)
		len++;
	if (at + len >= cap)
		return at; /* bounded by PATH_MAX names: cannot happen */
	snprintf(buf + at, cap - at, "%zu %s=%s\n", len, key, val);
	return at + len;
}

static void ustar(const char *name, char type, const struct stat *st, unsigned long long size,
		  const char *link)
{
	char h[512] = {0};
	snprintf(h, 100, "%s", name);
	snprintf(h + 100, 8, "%07o", (unsigned)(st->st_mode & 07777));
	snprintf(h + 108, 8, "%07o", (unsigned)(st->st_uid & 07777777));
	snprintf(h + 116, 8, "%07o", (unsigned)(st->st_gid & 07777777));
	snprintf(h + 124, 12, "%011llo", size & 077777777777ULL);
	long long mt = st->st_mtim.tv_sec < 0 ? 0 : (long long)st->st_mtim.tv_sec;
	snprintf(h + 136, 12, "%011llo", (unsigned long long)mt & 077777777777ULL);
	h[156] = type;
	if (link)
		snprintf(h + 157, 100, "%s", link);
	memcpy(h + 257, "ustar", 6);
	memcpy(h + 263, "00", 2);
	memset(h + 148, ' ', 8);
	unsigned sum = 0;
	for (int i = 0; i < 512; i++)
		sum += (unsigned char)h[i];
	snprintf(h + 148, 8, "%06o", sum);
	h[155] = ' ';
	out_write(h, 512);
}

static void entry(const char *name, char type, const struct stat *st, unsigned long long size,
		  const char *link)
{
	char pax[3 * PATH_MAX], num[32];
	size_t n = 0;
	if (strlen(name) > 99)
		n = pax_record(pax, sizeof pax, n, "path", name);
	if (link && strlen(link) > 99)
		n = pax_record(pax, sizeof pax, n, "linkpath", link);
	if (size > 077777777777ULL) {
		snprintf(num, sizeof num, "%llu", size);
		n = pax_record(pax, sizeof pax, n, "size", num);
	}
	if (st->st_uid > 07777777) {
		snprintf(num, sizeof num, "%u", (unsigned)st->st_uid);
		n = pax_record(pax, sizeof pax, n, "uid", num);
	}
	if (st->st_gid > 07777777) {
		snprintf(num, sizeof num, "%u", (unsigned)st->st_gid);
		n = pax_record(pax, sizeof pax, n, "gid", num);
	}
	snprintf(num, sizeof num, "%lld.%09ld", (long long)st->st_mtim.tv_sec,
		 (long)st->st_mtim.tv_nsec);
	n = pax_record(pax, sizeof pax, n, "mtime", num);
	struct stat pst = *st;
	pst.st_mode = 0644;
	ustar("PaxHeader", 'x', &pst, n, NULL);
	out_write(pax, n);
	out_pad(n);
	ustar(name, type, st, size, link);
	g_entries++;
}

static void pack_file(int dfd, const char *name, const char *rel, const struct stat *st)
{
	if (st->st_nlink > 1) {
		for (size_t i = 0; i < g_nlinks; i++)
			if (g_links[i].dev == st->st_dev && g_links[i].ino == st->st_ino) {
				entry(rel, '1', st, 0, g_links[i].name);
				return;
			}
		if (g_nlinks < PACK_LINKS && (g_links[g_nlinks].name = strdup(rel))) {
			g_links[g_nlinks].dev = st->st_dev;
			g_links[g_nlinks].ino = st->st_ino;
			g_nlinks++;
		}
	}
	int fd = openat(dfd, name, O_RDONLY | O_NOFOLLOW | O_NOCTTY | O_CLOEXEC);
	if (fd < 0) {
		pack_fail("open %.120s: %s", rel, strerror(errno));
		return;
	}
	unsigned long long size = (unsigned long long)st->st_size, done = 0;
	entry(rel, '0', st, size, NULL);
	static char buf[1 << 16];
	while (done < size && !g_pack_failed) {
		size_t want = size - done < sizeof buf ? (size_t)(size - done) : sizeof buf;
		ssize_t r = read(fd, buf, want);
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0) {
			pack_fail("read %.120s: %s", rel, strerror(errno));
			break;
		}
		if (r == 0) { /* shorter than its size said: keep the stream well-formed */
			memset(buf, 0, want);
			r = (ssize_t)want;
		}
		out_write(buf, (size_t)r);
		done += (unsigned long long)r;
	}
	close(fd);
	out_pad(size);
}

static void pack_dir(int dfd, char *rel, size_t len, int depth)
{
	DIR *d = fdopendir(dfd);
	if (!d) {
		close(dfd);
		pack_fail("read directory %.120s: %s", rel, strerror(errno));
		return;
	}
	struct dirent *de;
	while (!g_pack_failed && (de = readdir(d))) {
		const char *name = de->d_name;
		if (!strcmp(name, ".") || !strcmp(name, ".."))
			continue;
		size_t nl = strlen(name);
		if (len + 1 + nl + 16 >= PATH_MAX) {
			g_skipped++; /* a path too long for a tar (and for the host) */
			continue;
		}
		char *at = rel + len;
		snprintf(at, PATH_MAX - len, "%s%s", len ? "/" : "", name);
		size_t sublen = len + (len ? 1 : 0) + nl;
		struct stat st;
		if (fstatat(dirfd(d), name, &st, AT_SYMLINK_NOFOLLOW) < 0) {
			pack_fail("stat %.120s: %s", rel, strerror(errno));
		} else if (S_ISDIR(st.st_mode)) {
			if (depth >= PACK_MAX_DEPTH) {
				g_skipped++;
			} else {
				int sub = openat(dirfd(d), name,
						 O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
				if (sub < 0) {
					pack_fail("open %.120s: %s", rel, strerror(errno));
				} else {
					rel[sublen] = '/';
					rel[sublen + 1] = 0;
					entry(rel, '5', &st, 0, NULL);
					char v[4];
					ssize_t vn = fgetxattr(sub, "trusted.overlay.opaque", v, sizeof v);
					if (vn == 1 && v[0] == 'y') {
						struct stat ost = st;
						ost.st_mode = 0644;
						snprintf(rel + sublen, PATH_MAX - sublen, "/.wh..wh..opq");
						entry(rel, '0', &ost, 0, NULL);
					}
					rel[sublen] = 0;
					pack_dir(sub, rel, sublen, depth + 1);
				}
			}
		} else if (S_ISREG(st.st_mode)) {
			pack_file(dirfd(d), name, rel, &st);
		} else if (S_ISLNK(st.st_mode)) {
			char target[PATH_MAX];
			ssize_t tn = readlinkat(dirfd(d), name, target, sizeof target - 1);
			if (tn < 0) {
				pack_fail("readlink %.120s: %s", rel, strerror(errno));
			} else {
				target[tn] = 0;
				entry(rel, '2', &st, 0, target);
			}
		} else if (S_ISCHR(st.st_mode) && st.st_rdev == 0) {
			char wh[PATH_MAX + 8];
			snprintf(wh, sizeof wh, "%.*s%s.wh.%s", (int)len, rel, len ? "/" : "", name);
			struct stat wst = st;
			wst.st_mode = 0644;
			entry(wh, '0', &wst, 0, NULL);
		} else if (S_ISFIFO(st.st_mode)) {
			entry(rel, '6', &st, 0, NULL);
		} else {
			g_skipped++; /* sockets, device nodes: never part of a layer */
		}
		rel[len] = 0;
	}
	closedir(d);
}

static void pack_upper(int upper)
{
	char dev[64], rel[PATH_MAX + 32] = "";
	wait_drive("dsec-out", dev, sizeof dev);
	g_pack_fd = open(dev, O_WRONLY | O_CLOEXEC);
	if (g_pack_fd < 0 || ioctl(g_pack_fd, BLKGETSIZE64, &g_pack_cap) < 0)
		die("pack: open %s: %s", dev, strerror(errno));
	g_pack_cap -= 1024; /* room for the end-of-archive blocks */
	int fd = fcntl(upper, F_DUPFD_CLOEXEC, 0);
	if (fd < 0)
		die("pack: dup: %s", strerror(errno));
	pack_dir(fd, rel, 0, 0);
	g_pack_cap += 1024;
	static const char zero[1024];
	out_write(zero, sizeof zero);
	if (!g_pack_failed && fsync(g_pack_fd) < 0)
		pack_fail("sync the pack drive: %s", strerror(errno));
	close(g_pack_fd);
	char msg[240];
	int n;
	if (g_pack_failed) {
		n = snprintf(msg, sizeof msg, "pack: %s\n", g_pack_why);
		warn_line("%s", msg);
		write_file(VERIFY_DIR "/verify/error", 0644, msg, (size_t)n);
	} else {
		n = snprintf(msg, sizeof msg, "%llu %llu %llu\n", g_entries, g_pack_pos, g_skipped);
		write_file(PACK_STATUS, 0644, msg, (size_t)n);
	}
}

static void setup_verifier(const struct params *p)
{
	char path[MAX_PATHS_TEXT + 1], dst[MAX_PATHS_TEXT + 16], dev[64], serial[32];
	const unsigned long ns = MS_NOSUID | MS_NODEV;
	/* The platform's directory, owned by root, never from an image or the agent. */
	mkdir_p(VERIFY_DIR, 0755);
	do_mount("tmpfs", VERIFY_DIR, "tmpfs", ns, "mode=0755,size=16m");
	mkdir_p(VERIFY_DIR "/verify", 0755);
	mkdir_p(VERIFY_DIR "/result", 0700);
	mkdir_p(VERIFY_DIR "/home", 0700);
	copy_file("/dsec-untrusted", VERIFY_DIR "/untrusted", 0755);
	char hidden[MAX_PATHS_TEXT + 2];
	size_t hn = 0;
	for (int i = 0; nth_path(p->protected, i, path, sizeof path); i++)
		hn += (size_t)snprintf(hidden + hn, sizeof hidden - hn, "%s\n", path);
	write_file(VERIFY_DIR "/verify/hidden", 0644, hidden, hn);
	g_report = open(VERIFY_DIR "/verify/refused", O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
	if (g_report < 0)
		die("create refused list: %s", strerror(errno));

	for (int i = 0; nth_path(p->protected, i, path, sizeof path); i++) {
		if (i >= MAX_PROTECTED)
			die("more than %d protected paths", MAX_PROTECTED);
		snprintf(serial, sizeof serial, "dsec-p%d", i);
		snprintf(dst, sizeof dst, "/newroot%s", path);
		wait_drive(serial, dev, sizeof dev);
		int fd = newroot_dir(path);
		if (fd < 0)
			die("verify: cannot make the protected path %s", path);
		close(fd);
		do_mount(dev, dst, "erofs", MS_RDONLY | ns, NULL);
	}

	/* The agent's disk: data only, in the initramfs root. A file system that cannot be
	 * mounted (corrupt, garbage) fails the step closed: the host reads verify/error. */
	wait_drive("dsec-agent", dev, sizeof dev);
	mkdir_p(AGENT_MNT, 0700);
	mkdir_p(EMPTY_DIR, 0755);
	if (mount(dev, AGENT_MNT, "ext4", MS_RDONLY | MS_NOATIME | ns, "errors=remount-ro") < 0) {
		char msg[200];
		int n = snprintf(msg, sizeof msg, "the agent's disk cannot be mounted: %s\n",
				 strerror(errno));
		warn_line("verify: %s", msg);
		write_file(VERIFY_DIR "/verify/error", 0644, msg, (size_t)n);
		close(g_report);
		g_report = -1;
		return;
	}
	/* Every agent disk has upper/ (made at its first boot): without it (a link, a file,
	 * gone) the agent's work cannot be shown, and showing the pristine content in its
	 * place could pass a grader the agent never satisfied: fail closed. */
	int upper = open(AGENT_MNT "/upper", O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
	if (upper < 0) {
		char msg[200];
		int n = snprintf(msg, sizeof msg, "the agent's disk has no upper directory: %s\n",
				 strerror(errno));
		warn_line("verify: %s", msg);
		write_file(VERIFY_DIR "/verify/error", 0644, msg, (size_t)n);
		close(g_report);
		g_report = -1;
		return;
	}
	if (p->pack)
		pack_upper(upper);
	else
		for (int i = 0; nth_path(p->graded, i, path, sizeof path); i++)
			mount_graded(upper, path);
	close(upper);
	close(g_report);
	g_report = -1;
}

static void remove_initramfs_files(void)
{
	unlink("/modules.list");
	rmdir("/modules");
	unlink("/dsec-untrusted");
	unlink("/init");
}

static int service_main(const char *agent_path);

int main(int argc, char **args)
{
	if (argc == 3 && !strcmp(args[1], "--service"))
		return service_main(args[2]);
	if (getpid() != 1) { /* never die() here: its reboot would be the host's or a guest's */
		dprintf(2, "dsec-vminit: must run as pid 1 of a microVM (it mounts, loads modules "
			   "and switches root), or as: dsec-vminit --service /path/to/dsec-init\n");
		return 2;
	}
	umask(022);
	mkdir_p("/dev", 0755);
	mkdir_p("/proc", 0555);
	mkdir_p("/sys", 0555);
	do_mount("devtmpfs", "/dev", "devtmpfs", MS_NOSUID, "mode=0755");
	do_mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);
	do_mount("sysfs", "/sys", "sysfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, NULL);

	struct params p = {.layers = 0};
	char cmdline[MAX_GO + 1], why[160];
	if (read_small("/proc/cmdline", cmdline, sizeof cmdline) < 0)
		die("read /proc/cmdline: %s", strerror(errno));
	if (parse_params(cmdline, &p, why, sizeof why) < 0)
		die("%s", why);

	load_modules(0);
	char port[300];
	if (find_port(port, sizeof port) < 0)
		die("no virtio-serial port named %s (is -device virtserialport,name=%s there?)",
		    PORT_NAME, PORT_NAME);

	int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	struct sockaddr_un sun = {.sun_family = AF_UNIX, .sun_path = AGENT_SOCK};
	unlink(AGENT_SOCK);
	if (lfd < 0 || bind(lfd, (struct sockaddr *)&sun, sizeof sun) < 0 ||
	    chmod(AGENT_SOCK, 0600) < 0 || listen(lfd, 4096) < 0)
		die("agent socket %s: %s", AGENT_SOCK, strerror(errno));
	int exec_pipe[2], go_pipe[2] = {-1, -1};
	if (pipe2(exec_pipe, O_CLOEXEC) < 0 || (p.wait && pipe2(go_pipe, O_CLOEXEC) < 0))
		die("pipe: %s", strerror(errno));
	if (chdir("/") < 0)
		die("chdir /: %s", strerror(errno));
	pid_t mux = fork();
	if (mux < 0)
		die("fork: %s", strerror(errno));
	if (mux == 0) {
		close(lfd);
		close(exec_pipe[1]);
		if (go_pipe[0] >= 0)
			close(go_pipe[0]);
		mux_main(port, exec_pipe[0], go_pipe[1]);
		_exit(1);
	}
	close(exec_pipe[0]);
	if (p.wait) {
		close(go_pipe[1]);
		char go[MAX_GO + 2];
		ssize_t n, got = 0;
		while ((n = read(go_pipe[0], go + got, sizeof go - 1 - (size_t)got)) > 0)
			got += n;
		close(go_pipe[0]);
		if (got <= 0)
			die("the agent channel ended before the host's GO");
		go[got] = 0;
		struct params q = p;
		if (parse_params(go, &q, why, sizeof why) < 0)
			die("GO: %s", why);
		p = q;
	}

	load_modules(1);
	mount_root(&p);
	setup_network(&p);
	setup_resolv(&p);
	if (p.hostname[0] && sethostname(p.hostname, strlen(p.hostname)) < 0)
		die("sethostname: %s", strerror(errno));
	if (p.time_us > 0) {
		struct timeval tv = {.tv_sec = (time_t)(p.time_us / 1000000), .tv_usec = (suseconds_t)(p.time_us % 1000000)};
		if (settimeofday(&tv, NULL) < 0)
			die("settimeofday: %s", strerror(errno));
	}

	int agent = open("/dsec-init", O_RDONLY | O_CLOEXEC);
	if (agent < 0)
		die("open /dsec-init: %s", strerror(errno));
	unlink("/dsec-init");
	remove_initramfs_files();
	if (chdir("/newroot") < 0 || mount(".", "/", NULL, MS_MOVE, NULL) < 0 || chroot(".") < 0 ||
	    chdir("/") < 0)
		die("switch root: %s", strerror(errno));

	if (lfd == 3) {
		if (fcntl(3, F_SETFD, 0) < 0)
			die("fcntl: %s", strerror(errno));
	} else {
		if (agent == 3) {
			agent = fcntl(3, F_DUPFD_CLOEXEC, 4);
			if (agent < 0)
				die("fcntl: %s", strerror(errno));
		}
		if (dup2(lfd, 3) < 0)
			die("dup2: %s", strerror(errno));
		close(lfd);
	}
	char *argv[] = {(char *)"dsec-init", NULL};
	char *envp[] = {(char *)"PATH=" DEFAULT_PATH, (char *)"DSEC_AGENT_FD=3", NULL};
	syscall(SYS_execveat, agent, "", argv, envp, AT_EMPTY_PATH);
	int err = errno;
	if (write(exec_pipe[1], &err, sizeof err) < 0) {
	}
	die("exec the agent: %s", strerror(err));
}

/* ------------------------------------------------------------------------------------ */
/* service mode                                                                         */

/*
 * `dsec-vminit --service /path/to/dsec-init`: the agent in a full VM, started by the
 * image's own init (a systemd unit in debian-desktop, dsec.guest.desktopimage). The
 * guest booted itself, so none of pid 1's work happens here (no mounts, modules, root
 * switch, network, hostname): find the dsec.agent port, bind the agent's listening
 * socket in a root-only directory of /run (unreachable to unprivileged guest users),
 * then fork the mux (the same one as a microVM's: the host sees one channel protocol)
 * and the agent (exec'd with fd 3 that socket and DSEC_AGENT_FD=3; not being pid 1, it
 * makes itself the subreaper of what it starts). This process stays as their
 * supervisor: when either ends, the other is killed and it exits 1, so the service
 * manager restarts all three as one (a lone agent without its mux would serve nobody;
 * the host sees the port close and links the new mux). Both children die with it
 * (parent-death signal). No port (a VM booted without the channel): nothing to serve,
 * exit 0.
 */
static int service_main(const char *agent_path)
{
	g_service = 1;
	umask(022);
	if (agent_path[0] != '/')
		die("--service needs the agent's absolute path, not %s", agent_path);
	int agent = open(agent_path, O_RDONLY | O_CLOEXEC);
	if (agent < 0)
		die("open %s: %s", agent_path, strerror(errno));
	char port[300];
	if (find_port(port, sizeof port) < 0) {
		warn_line("no virtio-serial port named %s: no agent channel in this VM", PORT_NAME);
		return 0;
	}
	struct stat st;
	if (mkdir(SERVICE_DIR, 0700) < 0 && errno != EEXIST)
		die("mkdir %s: %s", SERVICE_DIR, strerror(errno));
	if (lstat(SERVICE_DIR, &st) < 0 || !S_ISDIR(st.st_mode) || st.st_uid != 0 ||
	    chmod(SERVICE_DIR, 0700) < 0)
		die("%s is not root's directory", SERVICE_DIR);
	g_agent_sock = SERVICE_SOCK;
	int lfd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	struct sockaddr_un sun = {.sun_family = AF_UNIX, .sun_path = SERVICE_SOCK};
	unlink(SERVICE_SOCK);
	if (lfd < 0 || bind(lfd, (struct sockaddr *)&sun, sizeof sun) < 0 ||
	    chmod(SERVICE_SOCK, 0600) < 0 || listen(lfd, 4096) < 0)
		die("agent socket %s: %s", SERVICE_SOCK, strerror(errno));
	int exec_pipe[2];
	if (pipe2(exec_pipe, O_CLOEXEC) < 0)
		die("pipe: %s", strerror(errno));
	if (chdir("/") < 0)
		die("chdir /: %s", strerror(errno));
	pid_t parent = getpid();
	pid_t mux = fork();
	if (mux < 0)
		die("fork: %s", strerror(errno));
	if (mux == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent) /* the supervisor is gone already */
			_exit(1);
		close(lfd);
		close(agent);
		close(exec_pipe[1]);
		mux_main(port, exec_pipe[0], -1);
		_exit(1);
	}
	close(exec_pipe[0]);
	pid_t child = fork();
	if (child < 0) {
		kill(mux, SIGKILL);
		die("fork: %s", strerror(errno));
	}
	if (child == 0) {
		prctl(PR_SET_PDEATHSIG, SIGKILL);
		if (getppid() != parent)
			_exit(1);
		if (lfd != 3) {
			if (agent == 3) {
				agent = fcntl(3, F_DUPFD_CLOEXEC, 4);
				if (agent < 0)
					die("fcntl: %s", strerror(errno));
			}
			if (dup2(lfd, 3) < 0)
				die("dup2: %s", strerror(errno));
			close(lfd);
		} else if (fcntl(3, F_SETFD, 0) < 0) {
			die("fcntl: %s", strerror(errno));
		}
		char *argv[] = {(char *)"dsec-init", NULL};
		char *envp[] = {(char *)"PATH=" DEFAULT_PATH, (char *)"DSEC_AGENT_FD=3", NULL};
		syscall(SYS_execveat, agent, "", argv, envp, AT_EMPTY_PATH);
		int err = errno;
		if (write(exec_pipe[1], &err, sizeof err) < 0) {
		}
		die("exec the agent: %s", strerror(err));
	}
	close(exec_pipe[1]);
	close(lfd);
	close(agent);
	prctl(PR_SET_NAME, "dsec-agentsv");
	int status = 0;
	pid_t ended;
	while ((ended = waitpid(-1, &status, 0)) < 0 && errno == EINTR) {
	}
	warn_line("the %s ended (status %d): restarting both", ended == mux ? "mux" : "agent",
		  status);
	kill(ended == mux ? child : mux, SIGKILL);
	while (waitpid(-1, NULL, 0) > 0 || errno == EINTR) {
	}
	return 1;
}
