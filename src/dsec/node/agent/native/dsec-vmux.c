/*
 * dsec-vmux: the guest half of the agent channel of a VM sandbox.
 *
 * In a container the edge reaches dsec-init over a unix socket and passes it
 * file descriptors. A VM has one byte stream to the host instead (a
 * virtio-serial port), so this process multiplexes that stream into channels
 * and stands in for the host's fds: for a spawn it makes the pipes, socketpairs
 * or ptys locally, hands them to dsec-init over SCM_RIGHTS exactly as the edge
 * does for a container, and pumps their bytes to and from the host. It also
 * does the file operations and TCP connections that the edge does through
 * /proc/PID/root and setns for containers. It uses nothing from the guest's
 * root filesystem, so replacing a binary there cannot change what it runs.
 *
 * Wire format, both directions: frames of [u32 channel][u32 length][payload],
 * little endian. Channel 0 carries requests and replies: NUL-separated fields,
 * the first a request id chosen by the host and echoed in the reply. Other
 * channels carry bytes; a zero-length frame is end of file for the direction
 * it travels. Only the host opens channels.
 *
 * Control requests:
 *   id S nspec spec... <dsec-init's S fields after "S">  spawn; spec is
 *        i<ch> (child reads), o<ch> (child writes), b<ch> (both, socketpair),
 *        t<ch>:<cols>:<rows> (a pty), n (/dev/null); same channel twice = same fd.
 *   id T|G|W|A ...           passed to dsec-init as is (see dsec-init.c)
 *   id H key ch...           hold: these channels outlive the host's connection (a
 *                            shell session's, so it survives a restart of the edge)
 *   id L                     reply "L key..." of the held sets
 *   id R key                 retrieve: reply "F key ch:kind..." (kind i: the child
 *                            reads, o: it writes), the channels now belong to this
 *                            connection; "E 2" if unknown
 *   id D key                 forget a held set (its channels stay as they are)
 *   id Fr ch path limit      read a file: reply "K size", bytes on ch, then EOF
 *   id Fw ch mode path       write a file from ch's bytes; reply after EOF
 *   id Fs path               stat: reply "K type size mode mtime target"
 *   id Fl ch path            list: records of 6 fields on ch, then EOF; reply first
 *   id Fm path               mkdir -p
 *   id Fd path recursive     remove
 *   id C ch port             connect to 127.0.0.1:port, bytes both ways on ch
 *   id Z ch cols rows        resize the pty on ch
 *   id I hostname unixns hexseed   identity after a boot or a clone: hostname,
 *                            clock, fresh entropy
 *   id Q                     reply "K ticks": the guest's boot clock (CLOCK_BOOTTIME in
 *                            /proc/PID/stat units), re-read after a restore
 *   id V epoch               resynchronise after the host (re)connected: all
 *                            channels are dropped; the reply is the raw marker
 *                            DSEC-SYNC:<epoch>:<boottime ticks>:<highest channel id
 *                            kept>\n, then frames. Held channels are kept, parked
 *                            (not read) until retrieved; all others are dropped.
 * Replies: "id K ...", "id E errno", "id P pid" (spawn). Exit notices from
 * dsec-init are forwarded as "0 X pid status".
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <linux/random.h>
#include <netinet/in.h>
#include <poll.h>
#include <pty.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <termios.h>
#include <time.h>
#include <unistd.h>

#define MAX_CH 1024
#define MAX_FRAME (1 << 20)
#define MAX_BUF (64 << 20)
#define MAX_PENDING 4096
#define INIT_FD 3

enum { K_FREE, K_IN, K_OUT, K_BOTH, K_PTY, K_FILE_IN };

struct chan {
    uint32_t id;
    int kind;
    int fd;          /* our end */
    int child_fd;    /* the child's end until the spawn request has gone */
    int rd_open;     /* we still read fd and send to the host */
    int wr_open;     /* we still write what the host sends into fd */
    char *buf;       /* host bytes not yet written to fd */
    size_t blen, boff;
    char reqid[32];  /* K_FILE_IN: reply to send at EOF ("" for none) */
    int err;         /* K_FILE_IN: first write error */
    int parked;      /* held across a reconnect and not yet retrieved: not read */
};

#define MAX_HELD 64
static struct { char key[128]; uint32_t ids[8]; int n; } held[MAX_HELD];

static struct chan ch[MAX_CH];
static int port = -1;
static char rbuf[MAX_FRAME + 8];
static size_t rlen;
static char pending[MAX_PENDING][32]; /* request ids sent to dsec-init, in order */
static int p_head, p_count;

static void write_all(int fd, const void *p, size_t n) {
    const char *c = p;
    while (n) {
        ssize_t w = write(fd, c, n);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) { struct pollfd pf = {fd, POLLOUT, 0}; poll(&pf, 1, 100); continue; }
            _exit(3);
        }
        c += w; n -= (size_t)w;
    }
}

static void send_frame(uint32_t id, const void *p, size_t n) {
    char hdr[8];
    uint32_t len = (uint32_t)n;
    memcpy(hdr, &id, 4);
    memcpy(hdr + 4, &len, 4);
    if (n + 8 <= 65536) {
        char out[65536];
        memcpy(out, hdr, 8);
        memcpy(out + 8, p, n);
        write_all(port, out, n + 8);
    } else {
        write_all(port, hdr, 8);
        write_all(port, p, n);
    }
}

/* a control message: fields joined with NUL; spaces in fmt separate fields */
static void reply(const char *id, const char *fmt, ...) {
    char out[8192];
    int n = snprintf(out, sizeof out, "%s ", id);
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(out + n, sizeof out - (size_t)n, fmt, ap);
    va_end(ap);
    if (n >= (int)sizeof out) n = sizeof out - 1;
    for (int i = 0; i < n; i++) if (out[i] == ' ') out[i] = '\0';
    send_frame(0, out, (size_t)n);
}

static void reply_fields(const char *id, char **f, int nf) {
    char out[8192];
    size_t n = 0;
    n += (size_t)snprintf(out, sizeof out, "%s", id) + 1;
    for (int i = 0; i < nf && n < sizeof out; i++) {
        size_t l = strlen(f[i]);
        if (n + l + 1 > sizeof out) break;
        memcpy(out + n, f[i], l + 1);
        n += l + 1;
    }
    send_frame(0, out, n - 1);
}

static struct chan *find(uint32_t id) {
    for (int i = 0; i < MAX_CH; i++) if (ch[i].kind != K_FREE && ch[i].id == id) return &ch[i];
    return NULL;
}

static struct chan *alloc_ch(uint32_t id, int kind, int fd) {
    for (int i = 0; i < MAX_CH; i++)
        if (ch[i].kind == K_FREE) {
            memset(&ch[i], 0, sizeof ch[i]);
            ch[i].id = id; ch[i].kind = kind; ch[i].fd = fd; ch[i].child_fd = -1;
            fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
            fcntl(fd, F_SETFD, FD_CLOEXEC);
            return &ch[i];
        }
    return NULL;
}

static void free_ch(struct chan *c) {
    if (c->fd >= 0) close(c->fd);
    if (c->child_fd >= 0) close(c->child_fd);
    free(c->buf);
    memset(c, 0, sizeof *c);
    c->kind = K_FREE;
}

static void maybe_free(struct chan *c) {
    if (!c->rd_open && !c->wr_open) free_ch(c);
}

static void stop_reading(struct chan *c) {
    if (!c->rd_open) return;
    c->rd_open = 0;
    send_frame(c->id, "", 0);
    maybe_free(c);
}

static void stop_writing(struct chan *c) {
    c->wr_open = 0;
    free(c->buf); c->buf = NULL; c->blen = c->boff = 0;
    if (c->kind == K_BOTH) shutdown(c->fd, SHUT_WR);
    maybe_free(c);
}

static void flush_ch(struct chan *c) {
    while (c->boff < c->blen) {
        ssize_t w = write(c->fd, c->buf + c->boff, c->blen - c->boff);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) return;
            if (c->kind == K_IN) send_frame(c->id, "", 0); /* tell the host the reader is gone */
            stop_writing(c);
            return;
        }
        c->boff += (size_t)w;
    }
    c->blen = c->boff = 0;
}

static void on_data(uint32_t id, const char *p, size_t n) {
    struct chan *c = find(id);
    if (!c || !c->wr_open) return;
    if (n == 0) {
        if (c->kind == K_FILE_IN) {
            int bad = c->err;
            if (!bad && fsync(c->fd) < 0) bad = errno;
            if (c->reqid[0]) { if (bad) reply(c->reqid, "E %d", bad); else reply(c->reqid, "K 0"); }
            free_ch(c);
            return;
        }
        if (c->kind == K_PTY) return; /* the child may still write to its terminal */
        c->wr_open = 2;
        flush_ch(c);
        if (c->kind != K_FREE && c->wr_open == 2 && c->blen == 0) stop_writing(c);
        return;
    }
    if (c->kind == K_FILE_IN) {
        if (!c->err) {
            size_t off = 0;
            while (off < n) {
                ssize_t w = write(c->fd, p + off, n - off);
                if (w < 0) { if (errno == EINTR) continue; c->err = errno; break; }
                off += (size_t)w;
            }
        }
        return;
    }
    if (c->blen - c->boff + n > MAX_BUF) { stop_writing(c); return; }
    if (c->blen == 0) {
        ssize_t w = write(c->fd, p, n);
        if (w < 0 && errno != EAGAIN && errno != EINTR) {
            if (c->kind == K_IN) send_frame(c->id, "", 0);
            stop_writing(c);
            return;
        }
        if (w < 0) w = 0;
        if ((size_t)w == n) return;
        p += w; n -= (size_t)w;
    }
    if (c->boff > 0 && c->boff == c->blen) c->blen = c->boff = 0;
    char *nb = realloc(c->buf, c->blen + n);
    if (!nb) { stop_writing(c); return; }
    c->buf = nb;
    memcpy(c->buf + c->blen, p, n);
    c->blen += n;
}

static long long boot_ticks(void);
static void do_held(const char *id, char **a, int na);

/* ---- requests ------------------------------------------------------------ */

static int split(char *p, size_t n, char **f, int max) {
    int nf = 0;
    size_t s = 0;
    p[n] = '\0';
    for (size_t i = 0; i <= n && nf < max; i++)
        if (p[i] == '\0') { f[nf++] = p + s; s = i + 1; }
    return nf;
}

static void to_init(const char *id, const char *msg, size_t n, int *fds, int nfds) {
    if (p_count >= MAX_PENDING) { reply(id, "E %d", EBUSY); return; }
    struct iovec iov = {(void *)msg, n};
    char cbuf[CMSG_SPACE(sizeof(int) * 8)];
    struct msghdr mh = {0};
    mh.msg_iov = &iov; mh.msg_iovlen = 1;
    if (nfds) {
        mh.msg_control = cbuf; mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)nfds);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET; cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)nfds);
        memcpy(CMSG_DATA(cm), fds, sizeof(int) * (size_t)nfds);
    }
    if (sendmsg(INIT_FD, &mh, MSG_NOSIGNAL) < 0) _exit(4);
    snprintf(pending[(p_head + p_count) % MAX_PENDING], 32, "%s", id);
    p_count++;
}

static void do_spawn(const char *id, char **f, int nf) {
    /* f[0]="S" f[1]=nspec f[2..] specs, then the rest for dsec-init */
    if (nf < 2) return;
    int ns = atoi(f[1]);
    if (ns < 0 || ns > 8 || nf < 2 + ns) { reply(id, "E %d", EINVAL); return; }
    int fds[8];
    struct chan *made[8];
    int nmade = 0, err = 0;
    for (int i = 0; i < ns; i++) {
        const char *s = f[2 + i];
        fds[i] = -1;
        if (s[0] == 'n') { fds[i] = open("/dev/null", O_RDWR | O_CLOEXEC); continue; }
        uint32_t cid = (uint32_t)strtoul(s + 1, NULL, 10);
        struct chan *c = find(cid);
        if (c && c->child_fd >= 0) { fds[i] = c->child_fd; continue; }
        if (c) { err = EEXIST; break; }
        int ours = -1, theirs = -1, kind;
        if (s[0] == 'i' || s[0] == 'o') {
            int p[2];
            if (pipe2(p, O_CLOEXEC) < 0) { err = errno; break; }
            kind = s[0] == 'i' ? K_IN : K_OUT;
            ours = s[0] == 'i' ? p[1] : p[0];
            theirs = s[0] == 'i' ? p[0] : p[1];
        } else if (s[0] == 'b') {
            int sp[2];
            if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sp) < 0) { err = errno; break; }
            kind = K_BOTH; ours = sp[0]; theirs = sp[1];
        } else if (s[0] == 't') {
            struct winsize ws = {24, 80, 0, 0};
            const char *a = strchr(s, ':');
            if (a) { ws.ws_col = (unsigned short)atoi(a + 1); a = strchr(a + 1, ':'); }
            if (a) ws.ws_row = (unsigned short)atoi(a + 1);
            if (openpty(&ours, &theirs, NULL, NULL, &ws) < 0) { err = errno; break; }
            kind = K_PTY;
        } else { err = EINVAL; break; }
        c = alloc_ch(cid, kind, ours);
        if (!c) { close(ours); close(theirs); err = EMFILE; break; }
        c->child_fd = theirs;
        c->rd_open = kind != K_IN;
        c->wr_open = kind != K_OUT;
        made[nmade++] = c;
        fds[i] = theirs;
    }
    if (err) {
        for (int i = 0; i < nmade; i++) free_ch(made[i]);
        for (int i = 0; i < ns; i++) if (fds[i] >= 0 && f[2 + i][0] == 'n') close(fds[i]);
        reply(id, "E %d 0", err);
        return;
    }
    /* rebuild "S\0rest..." for dsec-init */
    static char msg[262144];
    size_t n = 0;
    msg[n++] = 'S'; msg[n++] = '\0';
    for (int i = 2 + ns; i < nf; i++) {
        size_t l = strlen(f[i]);
        if (n + l + 1 > sizeof msg) { err = E2BIG; break; }
        memcpy(msg + n, f[i], l + 1);
        n += l + 1;
    }
    if (!err) to_init(id, msg, n - 1, fds, ns);
    else reply(id, "E %d 0", err);
    for (int i = 0; i < ns; i++) if (f[2 + i][0] == 'n' && fds[i] >= 0) close(fds[i]);
    for (int i = 0; i < nmade; i++) { close(made[i]->child_fd); made[i]->child_fd = -1; }
    if (err) for (int i = 0; i < nmade; i++) free_ch(made[i]);
}

static int mkdirs(const char *path) {
    char tmp[4096];
    snprintf(tmp, sizeof tmp, "%s", path);
    for (char *p = tmp + 1; *p; p++)
        if (*p == '/') { *p = 0; if (mkdir(tmp, 0755) < 0 && errno != EEXIST) return errno; *p = '/'; }
    if (mkdir(tmp, 0755) < 0 && errno != EEXIST) return errno;
    return 0;
}

static int rm_one(const char *p, const struct stat *st, int type, struct FTW *ftw) {
    (void)st; (void)ftw;
    return (type == FTW_DP ? rmdir(p) : unlink(p)) < 0 ? errno : 0;
}

static const char *type_of(mode_t m) {
    return S_ISREG(m) ? "file" : S_ISDIR(m) ? "dir" : S_ISLNK(m) ? "symlink" : "other";
}

static void do_file(const char *id, char **f, int nf) {
    char op = f[0][1];
    struct stat st;
    if (op == 'r' && nf >= 4) {
        uint32_t cid = (uint32_t)strtoul(f[1], NULL, 10);
        long long limit = atoll(f[3]);
        int fd = open(f[2], O_RDONLY | O_NONBLOCK | O_CLOEXEC);
        if (fd < 0) { reply(id, "E %d", errno); return; }
        if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode)) { close(fd); reply(id, "E %d", S_ISDIR(st.st_mode) ? EISDIR : EINVAL); return; }
        if (st.st_size > limit) { close(fd); reply(id, "E %d", EFBIG); return; }
        reply(id, "K %lld", (long long)st.st_size);
        static char b[MAX_FRAME];
        long long total = 0;
        for (;;) {
            ssize_t r = read(fd, b, sizeof b);
            if (r < 0 && errno == EINTR) continue;
            if (r <= 0) break;
            total += r;
            if (total > limit) break;
            send_frame(cid, b, (size_t)r);
        }
        close(fd);
        send_frame(cid, "", 0);
    } else if (op == 'w' && nf >= 4) {
        uint32_t cid = (uint32_t)strtoul(f[1], NULL, 10);
        char dir[4096];
        snprintf(dir, sizeof dir, "%s", f[3]);
        char *slash = strrchr(dir, '/');
        if (slash && slash != dir) { *slash = 0; mkdirs(dir); }
        int fd = open(f[3], O_WRONLY | O_CREAT | O_NONBLOCK | O_CLOEXEC, (mode_t)strtol(f[2], NULL, 8));
        if (fd >= 0 && (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode))) { close(fd); fd = -1; errno = EINVAL; }
        if (fd >= 0) { fcntl(fd, F_SETFL, 0); if (ftruncate(fd, 0) < 0) { close(fd); fd = -1; } }
        if (fd < 0) { int e = errno; reply(id, "E %d", e);
            /* swallow the bytes that follow */
            struct chan *c = alloc_ch(cid, K_FILE_IN, open("/dev/null", O_WRONLY | O_CLOEXEC));
            if (c) { c->wr_open = 1; c->rd_open = 0; }
            return; }
        struct chan *c = alloc_ch(cid, K_FILE_IN, fd);
        if (!c) { close(fd); reply(id, "E %d", EMFILE); return; }
        fcntl(fd, F_SETFL, 0);
        c->wr_open = 1; c->rd_open = 0;
        snprintf(c->reqid, sizeof c->reqid, "%s", id);
    } else if (op == 's' && nf >= 2) {
        if (lstat(f[1], &st) < 0) { reply(id, "E %d", errno); return; }
        char target[4096] = "";
        if (S_ISLNK(st.st_mode)) { ssize_t l = readlink(f[1], target, sizeof target - 1); if (l > 0) target[l] = 0; }
        char *out[6];
        char size[32], mode[32], mtime[48];
        snprintf(size, sizeof size, "%lld", (long long)st.st_size);
        snprintf(mode, sizeof mode, "%o", st.st_mode & 07777);
        snprintf(mtime, sizeof mtime, "%lld.%09ld", (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
        out[0] = "K"; out[1] = (char *)type_of(st.st_mode); out[2] = size; out[3] = mode; out[4] = mtime; out[5] = target;
        reply_fields(id, out, 6);
    } else if (op == 'l' && nf >= 3) {
        uint32_t cid = (uint32_t)strtoul(f[1], NULL, 10);
        int dfd = open(f[2], O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        if (dfd < 0) { reply(id, "E %d", errno); return; }
        DIR *d = fdopendir(dfd);
        reply(id, "K 0");
        struct dirent *e;
        static char b[MAX_FRAME];
        size_t n = 0;
        while (d && (e = readdir(d))) {
            if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
            if (fstatat(dfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) < 0) continue;
            char target[4096] = "";
            if (S_ISLNK(st.st_mode)) { ssize_t l = readlinkat(dfd, e->d_name, target, sizeof target - 1); if (l > 0) target[l] = 0; }
            if (n + strlen(e->d_name) + strlen(target) + 128 > sizeof b) { send_frame(cid, b, n); n = 0; }
            n += (size_t)snprintf(b + n, sizeof b - n, "%s%c%s%c%lld%c%o%c%lld.%09ld%c%s%c", e->d_name, 0,
                                  type_of(st.st_mode), 0, (long long)st.st_size, 0, st.st_mode & 07777, 0,
                                  (long long)st.st_mtim.tv_sec, st.st_mtim.tv_nsec, 0, target, 0);
        }
        if (n) send_frame(cid, b, n);
        if (d) closedir(d);
        send_frame(cid, "", 0);
    } else if (op == 'm' && nf >= 2) {
        int e = mkdirs(f[1]);
        if (e) reply(id, "E %d", e); else reply(id, "K 0");
    } else if (op == 'd' && nf >= 3) {
        if (lstat(f[1], &st) < 0) { reply(id, "E %d", errno); return; }
        int r;
        if (S_ISDIR(st.st_mode)) r = atoi(f[2]) ? nftw(f[1], rm_one, 64, FTW_DEPTH | FTW_PHYS) : (rmdir(f[1]) < 0 ? errno : 0);
        else r = unlink(f[1]) < 0 ? errno : 0;
        if (r) reply(id, "E %d", r); else reply(id, "K 0");
    } else {
        reply(id, "E %d", EINVAL);
    }
}

static void do_connect(const char *id, char **f, int nf) {
    if (nf < 3) { reply(id, "E %d", EINVAL); return; }
    uint32_t cid = (uint32_t)strtoul(f[1], NULL, 10);
    int s = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
    struct sockaddr_in a = {0};
    a.sin_family = AF_INET;
    a.sin_port = htons((uint16_t)atoi(f[2]));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (s < 0 || connect(s, (struct sockaddr *)&a, sizeof a) < 0) {
        int e = errno;
        if (s >= 0) close(s);
        reply(id, "E %d", e);
        return;
    }
    struct chan *c = alloc_ch(cid, K_BOTH, s);
    if (!c) { close(s); reply(id, "E %d", EMFILE); return; }
    c->rd_open = c->wr_open = 1;
    reply(id, "K 0");
}

static void do_identity(const char *id, char **f, int nf) {
    if (nf < 4) { reply(id, "E %d", EINVAL); return; }
    sethostname(f[1], strlen(f[1]));
    long long ns = atoll(f[2]);
    struct timespec ts = {ns / 1000000000LL, ns % 1000000000LL};
    clock_settime(CLOCK_REALTIME, &ts);
    size_t hl = strlen(f[3]) / 2;
    if (hl > 0 && hl <= 512) {
        struct { int count, size; unsigned char b[512]; } ent;
        for (size_t i = 0; i < hl; i++) { unsigned v; sscanf(f[3] + 2 * i, "%2x", &v); ent.b[i] = (unsigned char)v; }
        ent.count = (int)hl * 8; ent.size = (int)hl;
        int r = open("/dev/urandom", O_WRONLY | O_CLOEXEC);
        /* adding entropy to a ready RNG does not reseed it (only the next scheduled reseed,
           up to a minute later, would): force it, so a clone or branch child never goes on
           with its template's or parent's RNG state */
        if (r >= 0) { ioctl(r, RNDADDENTROPY, &ent); ioctl(r, RNDRESEEDCRNG); close(r); }
    }
    reply(id, "K 0");
}

static void on_control(char *p, size_t n) {
    static char *f[8200];
    int nf = split(p, n, f, 8200);
    if (nf < 2) return;
    const char *id = f[0];
    char **a = f + 1;
    int na = nf - 1;
    switch (a[0][0]) {
    case 'S': do_spawn(id, a, na); break;
    case 'H': case 'L': case 'R': case 'D': do_held(id, a, na); break;
    case 'T': case 'G': case 'W': case 'A': {
        /* the request without its id */
        char *start = a[0];
        to_init(id, start, (size_t)(p + n - start), NULL, 0);
        break;
    }
    case 'F': do_file(id, a, na); break;
    case 'C': do_connect(id, a, na); break;
    case 'Z':
        if (na >= 4) {
            struct chan *c = find((uint32_t)strtoul(a[1], NULL, 10));
            struct winsize ws = {(unsigned short)atoi(a[3]), (unsigned short)atoi(a[2]), 0, 0};
            if (c && c->kind == K_PTY) ioctl(c->fd, TIOCSWINSZ, &ws);
        }
        reply(id, "K 0");
        break;
    case 'I': do_identity(id, a, na); break;
    case 'Q': reply(id, "K %lld", boot_ticks()); break;
    default: reply(id, "E %d", ENOSYS); break;
    }
}

static long long boot_ticks(void) {
    struct timespec bt;
    clock_gettime(CLOCK_BOOTTIME, &bt);
    long tck = sysconf(_SC_CLK_TCK);
    return (long long)bt.tv_sec * tck + (long long)bt.tv_nsec * tck / 1000000000LL;
}

static int is_held(uint32_t id) {
    for (int i = 0; i < MAX_HELD; i++)
        for (int k = 0; held[i].key[0] && k < held[i].n; k++)
            if (held[i].ids[k] == id) return 1;
    return 0;
}

static void resync(const char *epoch) {
    /* the host repeats its hello until it sees the marker: answer each epoch once */
    static char last[64];
    if (!strcmp(last, epoch)) return;
    snprintf(last, sizeof last, "%s", epoch);
    uint32_t maxid = 0;
    for (int i = 0; i < MAX_CH; i++) {
        if (ch[i].kind == K_FREE) continue;
        if (is_held(ch[i].id)) {
            ch[i].parked = 1;
            free(ch[i].buf); ch[i].buf = NULL; ch[i].blen = ch[i].boff = 0;
            if (ch[i].wr_open == 2) ch[i].wr_open = 1;
            if (ch[i].id > maxid) maxid = ch[i].id;
        } else {
            free_ch(&ch[i]);
        }
    }
    char m[160];
    int n = snprintf(m, sizeof m, "DSEC-SYNC:%s:%lld:%u\n", epoch, boot_ticks(), maxid);
    write_all(port, m, (size_t)n);
}

static int held_find(const char *key) {
    for (int i = 0; i < MAX_HELD; i++) if (held[i].key[0] && !strcmp(held[i].key, key)) return i;
    return -1;
}

static void do_held(const char *id, char **a, int na) {
    char op = a[0][0];
    if (op == 'H') {
        if (na < 3 || na - 2 > 8 || strlen(a[1]) >= sizeof held[0].key) { reply(id, "E %d", EINVAL); return; }
        int i = held_find(a[1]);
        for (int k = 0; i < 0 && k < MAX_HELD; k++) if (!held[k].key[0]) i = k;
        if (i < 0) { reply(id, "E %d", ENOSPC); return; }
        snprintf(held[i].key, sizeof held[i].key, "%s", a[1]);
        held[i].n = na - 2;
        for (int k = 0; k < held[i].n; k++) held[i].ids[k] = (uint32_t)strtoul(a[2 + k], NULL, 10);
        reply(id, "K 0");
    } else if (op == 'L') {
        char *keys[MAX_HELD + 1];
        int n = 0;
        keys[n++] = "L";
        for (int i = 0; i < MAX_HELD; i++) if (held[i].key[0]) keys[n++] = held[i].key;
        reply_fields(id, keys, n);
    } else if (op == 'R' && na >= 2) {
        int i = held_find(a[1]);
        if (i < 0) { reply(id, "E %d", ENOENT); return; }
        static char specs[8][32];
        char *out[10];
        int n = 0;
        out[n++] = "F";
        out[n++] = held[i].key;
        for (int k = 0; k < held[i].n; k++) {
            struct chan *c = find(held[i].ids[k]);
            if (c) c->parked = 0;
            snprintf(specs[k], sizeof specs[k], "%u:%c", held[i].ids[k], !c ? 'x' : c->kind == K_IN ? 'i' : 'o');
            out[n++] = specs[k];
        }
        reply_fields(id, out, n);
    } else if (op == 'D' && na >= 2) {
        int i = held_find(a[1]);
        if (i >= 0) {
            for (int k = 0; k < held[i].n; k++) {
                struct chan *c = find(held[i].ids[k]);
                if (c && c->parked) free_ch(c); /* nobody will take them back */
            }
            held[i].key[0] = '\0';
        }
        reply(id, "K 0");
    } else {
        reply(id, "E %d", EINVAL);
    }
}

/* ---- replies from dsec-init --------------------------------------------- */

static void on_init(void) {
    static char msg[262144 + 64];
    char cbuf[CMSG_SPACE(sizeof(int) * 8)];
    struct iovec iov = {msg + 40, 262144};
    struct msghdr mh = {0};
    mh.msg_iov = &iov; mh.msg_iovlen = 1;
    mh.msg_control = cbuf; mh.msg_controllen = sizeof cbuf;
    ssize_t n = recvmsg(INIT_FD, &mh, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n == 0) _exit(5);
    if (n < 0) return;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c))
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int cnt = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < cnt; i++) { int fd; memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd); close(fd); }
        }
    const char *id = "0";
    if (msg[40] != 'X') {
        if (!p_count) return;
        id = pending[p_head];
        p_head = (p_head + 1) % MAX_PENDING;
        p_count--;
    }
    size_t il = strlen(id);
    char *start = msg + 40 - il - 1;
    memcpy(start, id, il);
    start[il] = '\0';
    send_frame(0, start, (size_t)n + il + 1);
}

/* ---- main loop ------------------------------------------------------------ */

static int find_port(void) {
    DIR *d = opendir("/sys/class/virtio-ports");
    struct dirent *e;
    while (d && (e = readdir(d))) {
        char p[512], name[128] = "";
        snprintf(p, sizeof p, "/sys/class/virtio-ports/%s/name", e->d_name);
        int fd = open(p, O_RDONLY);
        if (fd < 0) continue;
        ssize_t r = read(fd, name, sizeof name - 1);
        close(fd);
        if (r > 0 && !strncmp(name, "dsec.agent", 10)) {
            snprintf(p, sizeof p, "/dev/%s", e->d_name);
            closedir(d);
            return open(p, O_RDWR | O_CLOEXEC);
        }
    }
    if (d) closedir(d);
    return -1;
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    for (int i = 0; i < 100 && (port = find_port()) < 0; i++) usleep(20000);
    if (port < 0) return 2;
    static struct pollfd pf[MAX_CH + 2];
    for (;;) {
        int np = 0;
        pf[np].fd = port; pf[np].events = POLLIN; np++;
        pf[np].fd = INIT_FD; pf[np].events = POLLIN; np++;
        int map[MAX_CH];
        for (int i = 0; i < MAX_CH; i++) {
            struct chan *c = &ch[i];
            if (c->kind == K_FREE || c->kind == K_FILE_IN || c->fd < 0 || c->parked) continue;
            short ev = 0;
            if (c->rd_open) ev |= POLLIN;
            if (c->wr_open && c->blen > c->boff) ev |= POLLOUT;
            if (!ev) continue;
            pf[np].fd = c->fd; pf[np].events = ev; map[np - 2] = i; np++;
        }
        if (poll(pf, (nfds_t)np, -1) < 0) continue;
        if (pf[0].revents & POLLIN) {
            ssize_t r = read(port, rbuf + rlen, sizeof rbuf - rlen);
            if (r > 0) {
                rlen += (size_t)r;
                size_t off = 0;
                while (rlen - off >= 8) {
                    uint32_t id, len;
                    memcpy(&id, rbuf + off, 4);
                    memcpy(&len, rbuf + off + 4, 4);
                    if (len > MAX_FRAME) _exit(6);
                    if (rlen - off - 8 < len) break;
                    char *p = rbuf + off + 8;
                    if (id == 0) {
                        if (len > 2 && p[0] == '0' && p[1] == '\0' && p[2] == 'V') { /* "0 V epoch" */
                            char ep[64];
                            snprintf(ep, sizeof ep, "%.*s", (int)(len > 4 ? len - 4 : 0), p + 4);
                            resync(ep);
                        } else {
                            char save = p[len];
                            on_control(p, len);
                            p[len] = save;
                        }
                    } else {
                        on_data(id, p, len);
                    }
                    off += 8 + len;
                }
                memmove(rbuf, rbuf + off, rlen - off);
                rlen -= off;
            } else if (r == 0) {
                usleep(10000); /* host side not connected */
            }
        }
        if (pf[1].revents & (POLLIN | POLLHUP)) on_init();
        for (int k = 2; k < np; k++) {
            struct chan *c = &ch[map[k - 2]];
            if (c->kind == K_FREE) continue;
            if ((pf[k].revents & POLLOUT) && c->wr_open) {
                flush_ch(c);
                if (c->kind != K_FREE && c->wr_open == 2 && c->blen == 0) stop_writing(c);
            }
            if (c->kind == K_FREE) continue;
            if (pf[k].revents & (POLLIN | POLLHUP | POLLERR)) {
                static char b[65536 - 8];
                ssize_t r = read(c->fd, b, sizeof b);
                if (r > 0) send_frame(c->id, b, (size_t)r);
                else if (r == 0 || (errno != EAGAIN && errno != EINTR)) {
                    if (c->kind == K_PTY) { c->wr_open = 0; }
                    stop_reading(c);
                }
            }
        }
    }
}
