/*
 * dsec-init: PID 1 of every dsec container sandbox.
 *
 * It owns three things and nothing else:
 *   - reaping every process of the sandbox (it is the pid namespace's init);
 *   - spawning processes on request of the host-side agent, with the stdio fds
 *     the agent passes over SCM_RIGHTS;
 *   - killing process trees on request (per-command timeouts).
 *
 * Why a static C binary: it must run in images with no Python and no libc of
 * their own, and it must not depend on anything inside the image. The binary is
 * executed through /proc/self/fd/3 (crun --preserve-fds), so no path inside the
 * sandbox holds it; its only channel is a listening unix socket inherited as
 * fd 4, bound to a path on the host that the sandbox's mount namespace cannot
 * see. It marks itself non-dumpable, so root in the sandbox without
 * CAP_SYS_PTRACE can neither ptrace it nor open files under /proc/1/fd, and as the
 * namespace's init it cannot be killed from inside.
 *
 * Wire protocol (SOCK_SEQPACKET, one request per message, fields NUL-separated):
 *   "S" flags cwd argc argv... envc env... [uid gid]   + SCM_RIGHTS fds -> child fds 0..n-1
 *       (with uid and gid, the child drops to them, supplementary groups cleared,
 *       before it enters cwd: the sandbox's own binaries play no part in it)
 *        reply "P" pid | "E" errno stage (5: exec failed, 6: chdir to cwd failed)
 *        later, on the same connection: "X" pid wait-status
 *   "T" pid sig since_ticks include_self  kill descendants of pid started at or after
 *        since_ticks (/proc/PID/stat starttime); reply "K" count
 *   "G" pgid sig                          kill(-pgid, sig); reply "K" 0|errno
 *   "W"                                   ping; reply "O"
 *   "A" pid                               adopt: exits of pid now go to this connection;
 *                                         reply "K 0", or "K ESRCH" if it is gone
 *   "H" key + fds                         hold fds under key (an fd store, so shell
 *                                         sessions outlive a restart of the edge); "K 0"
 *   "R" key                               reply "F" key + the held fds (dups), or "E ENOENT"
 *   "D" key                               close and forget them; "K 0"
 *   "L"                                   reply "L" key...
 *   "C" idle + fds                        the workload's cgroup: each later child writes
 *                                         itself into these cgroup.procs fds (opened by
 *                                         the host) before anything else, takes OOM score
 *                                         500 (init keeps what the host gave it) and, if
 *                                         idle is 1, SCHED_IDLE; reply "K 0"
 *
 * VM mode (`dsec-init --vm MUX`): PID 1 of a VM sandbox's guest. There is no
 * host socket to listen on; dsec-init starts MUX (dsec-vmux) with one end of a
 * socketpair as its fd 3 and serves that single client, which speaks for the
 * host over the virtio channel. If the mux dies the channel is gone for good,
 * so the guest powers off and the host sees the VM end.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <grp.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sched.h>
#include <sys/reboot.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#define MAX_CLIENTS 256
#define MAX_TRACKED 4096
#define MAX_MSG 262144
#define MAX_FDS 8
#define MAX_ARGS 4096

#define F_SETSID 1
#define F_CTTY 2

extern char **environ;

/* how long a spawn waits for its child's exec before answering anyway: a child that is
   slow to exec (a workload at its CPU quota) must not hold every other request */
#define SPAWN_WAIT_MS 2000

static int clients[MAX_CLIENTS];
static int cg_fds[MAX_FDS], cg_nfds, cg_idle;
static int nclients;
static struct { pid_t pid; int client; } tracked[MAX_TRACKED];
static char msgbuf[MAX_MSG + 1];

static void send_str(int fd, const char *s, size_t n) {
    if (fd >= 0) (void)send(fd, s, n, MSG_NOSIGNAL | MSG_DONTWAIT);
}

static void replyf(int fd, const char *fmt, long a, long b) {
    char out[128];
    int n = snprintf(out, sizeof out, fmt, a, b);
    /* fields are NUL-separated on the wire, printf uses spaces */
    for (int i = 0; i < n; i++) if (out[i] == ' ') out[i] = '\0';
    send_str(fd, out, (size_t)n);
}

#define MAX_HELD 512
static struct { char key[128]; int fds[MAX_FDS]; int nfds; } held[MAX_HELD];

static int held_find(const char *key) {
    for (int i = 0; i < MAX_HELD; i++)
        if (held[i].nfds && strcmp(held[i].key, key) == 0) return i;
    return -1;
}

static void held_drop(int i) {
    for (int j = 0; j < held[i].nfds; j++) close(held[i].fds[j]);
    held[i].nfds = 0;
}

/* Put the calling (child) process in a fresh Landlock domain that restricts no file
 * access. What it buys is Landlock's ptrace scoping: a process may only ptrace, read
 * /proc/PID/mem or /proc/PID/environ of processes in its own domain or below. So a
 * process left behind by one command cannot read or patch the memory of a later
 * command (a test run whose result is the reward), although both run as root in the
 * same sandbox. Best effort: kernels without Landlock just skip it. */
static void landlock_domain(void) {
    struct { uint64_t handled_access_fs; } attr = { 1ULL /* LANDLOCK_ACCESS_FS_EXECUTE */ };
    int rs = (int)syscall(444 /* landlock_create_ruleset */, &attr, sizeof attr, 0);
    if (rs < 0) return;
    int root = open("/", O_PATH | O_CLOEXEC);
    struct __attribute__((packed)) { uint64_t allowed_access; int32_t parent_fd; } beneath = { 1ULL, root };
    if (root >= 0 && syscall(445 /* landlock_add_rule */, rs, 1 /* PATH_BENEATH */, &beneath, 0) == 0)
        (void)syscall(446 /* landlock_restrict_self */, rs, 0);
    if (root >= 0) close(root);
    close(rs);
}

/* Returns 1 if the fds were kept (the caller must not close them). */
static int do_hold(int client, const char *key, int *fds, int nfds) {
    int i = held_find(key);
    if (i >= 0) held_drop(i);
    for (i = 0; i < MAX_HELD && held[i].nfds; i++) {}
    if (i == MAX_HELD || nfds == 0 || strlen(key) >= sizeof held[i].key) {
        replyf(client, "K %ld %ld", ENOSPC, 0);
        return 0;
    }
    snprintf(held[i].key, sizeof held[i].key, "%s", key);
    memcpy(held[i].fds, fds, sizeof(int) * (size_t)nfds);
    held[i].nfds = nfds;
    replyf(client, "K %ld %ld", 0, 0);
    return 1;
}

static void do_retrieve(int client, const char *key) {
    int i = held_find(key);
    if (i < 0) { replyf(client, "E %ld %ld", ENOENT, 0); return; }
    char out[160];
    int n = snprintf(out, sizeof out, "F%c%s", 0, key);
    struct iovec iov = { out, (size_t)n };
    char cbuf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
    memset(cbuf, 0, sizeof cbuf);
    struct msghdr mh = { 0 };
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)held[i].nfds);
    struct cmsghdr *c = CMSG_FIRSTHDR(&mh);
    c->cmsg_level = SOL_SOCKET;
    c->cmsg_type = SCM_RIGHTS;
    c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)held[i].nfds);
    memcpy(CMSG_DATA(c), held[i].fds, sizeof(int) * (size_t)held[i].nfds);
    (void)sendmsg(client, &mh, MSG_NOSIGNAL);
}

static void do_list(int client) {
    static char out[MAX_HELD * 130 + 2];
    size_t n = 0;
    out[n++] = 'L';
    for (int i = 0; i < MAX_HELD; i++) {
        if (!held[i].nfds) continue;
        out[n++] = 0;
        size_t k = strlen(held[i].key);
        memcpy(out + n, held[i].key, k);
        n += k;
    }
    send_str(client, out, n);
}

static void track(pid_t pid, int client) {
    for (int i = 0; i < MAX_TRACKED; i++)
        if (tracked[i].pid == 0) { tracked[i].pid = pid; tracked[i].client = client; return; }
}

static void on_exit_status(pid_t pid, int status) {
    for (int i = 0; i < MAX_TRACKED; i++) {
        if (tracked[i].pid == pid) {
            replyf(tracked[i].client, "X %ld %ld", pid, status);
            tracked[i].pid = 0;
            return;
        }
    }
}

static int vm_mode;

static void drop_client(int idx) {
    int fd = clients[idx];
    if (vm_mode) { sync(); reboot(RB_POWER_OFF); }
    for (int i = 0; i < MAX_TRACKED; i++)
        if (tracked[i].pid && tracked[i].client == fd) tracked[i].client = -1;
    close(fd);
    clients[idx] = clients[--nclients];
}

/* Split msg into NUL-terminated fields; returns count. */
static int split(char *msg, size_t len, char **fields, int max) {
    int n = 0;
    size_t start = 0;
    msg[len] = '\0';
    for (size_t i = 0; i <= len && n < max; i++) {
        if (msg[i] == '\0') {
            fields[n++] = msg + start;
            start = i + 1;
        }
    }
    return n;
}

static void do_spawn(int client, char **f, int nf, int *fds, int nfds) {
    if (nf < 4) { replyf(client, "E %ld %ld", EINVAL, 0); return; }
    int flags = atoi(f[1]);
    const char *cwd = f[2];
    int argc = atoi(f[3]);
    if (argc < 1 || 4 + argc >= nf) { replyf(client, "E %ld %ld", EINVAL, 1); return; }
    char **argv = calloc((size_t)argc + 1, sizeof(char *));
    for (int i = 0; i < argc; i++) argv[i] = f[4 + i];
    int envc = atoi(f[4 + argc]);
    if (envc < 0 || 5 + argc + envc > nf) { free(argv); replyf(client, "E %ld %ld", EINVAL, 2); return; }
    char **envp = calloc((size_t)envc + 1, sizeof(char *));
    for (int i = 0; i < envc; i++) envp[i] = f[5 + argc + i];
    long uid = -1, gid = -1;
    if (nf >= 7 + argc + envc) {
        uid = atol(f[5 + argc + envc]);
        gid = atol(f[6 + argc + envc]);
        if (uid < 0 || gid < 0) { free(argv); free(envp); replyf(client, "E %ld %ld", EINVAL, 7); return; }
    }

    int errpipe[2];
    if (pipe2(errpipe, O_CLOEXEC) < 0) { free(argv); free(envp); replyf(client, "E %ld %ld", errno, 3); return; }
    pid_t pid = fork();
    if (pid == 0) {
        /* into the workload's cgroup before anything else: what it does from here on
           counts against the sandbox's limits, not init's reserve */
        for (int i = 0; i < cg_nfds; i++) {
            if (write(cg_fds[i], "0", 1) < 0) { int e[2] = { errno, 8 }; (void)!write(errpipe[1], e, sizeof e); _exit(126); }
        }
        int oom = open("/proc/self/oom_score_adj", O_WRONLY | O_CLOEXEC);
        if (oom >= 0) { (void)!write(oom, "500", 3); close(oom); }
        if (cg_idle) { struct sched_param sp = { 0 }; sched_setscheduler(0, SCHED_IDLE, &sp); }
        for (int i = 0; i < cg_nfds; i++) close(cg_fds[i]);
        sigset_t all;
        sigfillset(&all);
        for (int s = 1; s < NSIG; s++) signal(s, SIG_DFL);
        sigprocmask(SIG_UNBLOCK, &all, NULL);
        /* move passed fds out of the way, then onto 0..n-1 */
        int tmp[MAX_FDS];
        for (int i = 0; i < nfds; i++) tmp[i] = fcntl(fds[i], F_DUPFD_CLOEXEC, 64);
        for (int i = 0; i < nfds; i++) { dup2(tmp[i], i); }
        if (nfds == 0) {
            int nul = open("/dev/null", O_RDWR);
            dup2(nul, 0); dup2(nul, 1); dup2(nul, 2);
        }
        if (flags & (F_SETSID | F_CTTY)) setsid();
        if (flags & F_CTTY) ioctl(0, TIOCSCTTY, 0);
        if (uid >= 0) {
            gid_t g = (gid_t)gid;
            if (setgroups(1, &g) < 0 || setgid(g) < 0 || setuid((uid_t)uid) < 0) {
                int e[2] = { errno, 7 }; (void)!write(errpipe[1], e, sizeof e); _exit(126);
            }
        }
        if (chdir(cwd) < 0) { int e[2] = { errno, 6 }; (void)!write(errpipe[1], e, sizeof e); _exit(126); }
        landlock_domain();
        environ = envp;
        execvp(argv[0], argv);
        int e[2] = { errno, 5 };
        (void)!write(errpipe[1], e, sizeof e);
        _exit(127);
    }
    close(errpipe[1]);
    for (int i = 0; i < nfds; i++) close(fds[i]);
    free(argv);
    free(envp);
    if (pid < 0) { close(errpipe[0]); replyf(client, "E %ld %ld", errno, 4); return; }
    int childerr[2] = { 0, 0 };
    ssize_t r = 0;
    struct pollfd ep = { errpipe[0], POLLIN, 0 };
    int pr;
    do { pr = poll(&ep, 1, SPAWN_WAIT_MS); } while (pr < 0 && errno == EINTR);
    if (pr > 0) {
        do { r = read(errpipe[0], childerr, sizeof childerr); } while (r < 0 && errno == EINTR);
    }
    close(errpipe[0]);
    if (r == (ssize_t)sizeof childerr) {
        /* the child already exited (or will): it is reaped by the SIGCHLD path untracked */
        replyf(client, "E %ld %ld", childerr[0], childerr[1]);
        return;
    }
    track(pid, client);
    replyf(client, "P %ld %ld", pid, 0);
}

/* Read /proc/PID/stat for ppid and starttime. */
static int proc_stat(pid_t pid, pid_t *ppid, unsigned long long *start) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return -1;
    buf[n] = '\0';
    char *p = strrchr(buf, ')');
    if (!p) return -1;
    /* after ") " : state(3) ppid(4) ... starttime(22) */
    int field = 3;
    char *tok = strtok(p + 2, " ");
    while (tok) {
        if (field == 4) *ppid = (pid_t)atoi(tok);
        if (field == 22) { *start = strtoull(tok, NULL, 10); return 0; }
        tok = strtok(NULL, " ");
        field++;
    }
    return -1;
}

static pid_t kt_pids[65536], kt_ppids[65536];
static unsigned long long kt_starts[65536];
static int kt_order[65536];
static char kt_mark[65536]; /* 0 unknown, 1 under root, 2 not */

static int kt_cmp(const void *a, const void *b) {
    pid_t x = kt_pids[*(const int *)a], y = kt_pids[*(const int *)b];
    return (x > y) - (x < y);
}

static int kt_find(int n, pid_t pid) {
    int lo = 0, hi = n - 1;
    while (lo <= hi) {
        int mid = (lo + hi) / 2;
        pid_t p = kt_pids[kt_order[mid]];
        if (p == pid) return kt_order[mid];
        if (p < pid) lo = mid + 1; else hi = mid - 1;
    }
    return -1;
}

/* Is process i a descendant of root? Walks up the parent chain once per process
   (answers are remembered), so a tree of thousands (a fork bomb) costs n log n. */
static int kt_under(int n, int i, pid_t root) {
    static int chain[65536];
    int len = 0, verdict;
    for (;;) {
        if (i < 0) { verdict = 2; break; }
        if (kt_mark[i]) { verdict = kt_mark[i] == 3 ? 2 : kt_mark[i]; break; } /* 3: a cycle (pid reuse mid-scan) */
        kt_mark[i] = 3;
        chain[len++] = i;
        if (kt_ppids[i] == root) { verdict = 1; break; }
        i = kt_find(n, kt_ppids[i]);
    }
    for (int k = 0; k < len; k++) kt_mark[chain[k]] = (char)verdict;
    return verdict == 1;
}

static int kill_tree(pid_t root, int sig, unsigned long long since, int include_self) {
    int n = 0;
    DIR *d = opendir("/proc");
    if (!d) return 0;
    struct dirent *de;
    while ((de = readdir(d)) && n < 65536) {
        pid_t p = (pid_t)atoi(de->d_name);
        if (p <= 1) continue;
        if (proc_stat(p, &kt_ppids[n], &kt_starts[n]) == 0) { kt_pids[n] = p; kt_order[n] = n; n++; }
    }
    closedir(d);
    memset(kt_mark, 0, (size_t)n);
    qsort(kt_order, (size_t)n, sizeof kt_order[0], kt_cmp);
    int killed = 0;
    for (int i = 0; i < n; i++)
        if (kt_under(n, i, root) && kt_starts[i] >= since) kill(kt_pids[i], SIGSTOP);
    for (int i = 0; i < n; i++) {
        if (kt_mark[i] == 1 && kt_starts[i] >= since) { kill(kt_pids[i], sig); kill(kt_pids[i], SIGCONT); killed++; }
    }
    if (include_self) { kill(root, sig); killed++; }
    return killed;
}

static void handle(int idx) {
    int client = clients[idx];
    struct iovec iov = { msgbuf, MAX_MSG };
    char cbuf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
    struct msghdr mh = { 0 };
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = cbuf;
    mh.msg_controllen = sizeof cbuf;
    ssize_t n = recvmsg(client, &mh, MSG_CMSG_CLOEXEC);
    if (n <= 0) { drop_client(idx); return; }
    int fds[MAX_FDS], nfds = 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&mh); c; c = CMSG_NXTHDR(&mh, c)) {
        if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SCM_RIGHTS) {
            int cnt = (int)((c->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < cnt; i++) {
                int fd;
                memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
                if (nfds < MAX_FDS) fds[nfds++] = fd; else close(fd);
            }
        }
    }
    static char *f[MAX_ARGS * 2 + 8];
    int nf = split(msgbuf, (size_t)n, f, MAX_ARGS * 2 + 8);
    if (nf < 1) goto done;
    switch (f[0][0]) {
    case 'S':
        do_spawn(client, f, nf, fds, nfds);
        return;
    case 'T':
        if (nf >= 5) {
            int k = kill_tree((pid_t)atoi(f[1]), atoi(f[2]), strtoull(f[3], NULL, 10), atoi(f[4]));
            replyf(client, "K %ld %ld", k, 0);
        }
        break;
    case 'G':
        if (nf >= 3) {
            int r = kill(-(pid_t)atoi(f[1]), atoi(f[2]));
            replyf(client, "K %ld %ld", r < 0 ? errno : 0, 0);
        }
        break;
    case 'W':
        send_str(client, "O", 1);
        break;
    case 'A':
        if (nf >= 2) {
            pid_t pid = (pid_t)atoi(f[1]);
            int found = 0;
            for (int i = 0; i < MAX_TRACKED; i++)
                if (tracked[i].pid == pid) { tracked[i].client = client; found = 1; }
            replyf(client, "K %ld %ld", found ? 0 : ESRCH, 0);
        }
        break;
    case 'H':
        if (nf >= 2 && do_hold(client, f[1], fds, nfds)) return;
        if (nf < 2) replyf(client, "K %ld %ld", EINVAL, 0);
        break;
    case 'R':
        if (nf >= 2) do_retrieve(client, f[1]);
        break;
    case 'D':
        if (nf >= 2) {
            int i = held_find(f[1]);
            if (i >= 0) held_drop(i);
            replyf(client, "K %ld %ld", 0, 0);
        }
        break;
    case 'L':
        do_list(client);
        break;
    case 'C':
        for (int i = 0; i < cg_nfds; i++) close(cg_fds[i]);
        cg_nfds = 0;
        cg_idle = nf >= 2 && f[1][0] == '1';
        /* far from 0..n-1, where a spawned child's fds land */
        for (int i = 0; i < nfds; i++) { cg_fds[cg_nfds++] = fcntl(fds[i], F_DUPFD_CLOEXEC, 100); close(fds[i]); }
        replyf(client, "K %ld %ld", 0, 0);
        return;
    default:
        break;
    }
done:
    for (int i = 0; i < nfds; i++) close(fds[i]);
}

static int start_mux(const char *path) {
    int sp[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sp) < 0) return -1;
    pid_t p = fork();
    if (p == 0) {
        dup2(sp[1], 3); /* dup2 clears close-on-exec on the copy */
        char *argv[] = {(char *)path, NULL};
        execve(path, argv, environ);
        _exit(127);
    }
    close(sp[1]);
    if (p < 0) { close(sp[0]); return -1; }
    clients[nclients++] = sp[0];
    return 0;
}

int main(int argc, char **argv) {
    prctl(PR_SET_DUMPABLE, 0, 0, 0, 0);
    int lfd = 4;
    if (argc == 3 && !strcmp(argv[1], "--vm")) {
        vm_mode = 1;
        lfd = -1;
        if (start_mux(argv[2]) < 0) { reboot(RB_POWER_OFF); return 1; }
    } else {
        close(3); /* our own binary, passed by crun --preserve-fds */
        fcntl(lfd, F_SETFD, FD_CLOEXEC);
    }
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    sigaddset(&mask, SIGTERM);
    sigaddset(&mask, SIGINT);
    sigaddset(&mask, SIGHUP);
    sigaddset(&mask, SIGPIPE);
    sigprocmask(SIG_BLOCK, &mask, NULL);
    int sfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    int nul = open("/dev/null", O_RDWR | O_CLOEXEC);
    if (nul >= 0) { dup2(nul, 0); dup2(nul, 1); dup2(nul, 2); }

    struct pollfd pfd[MAX_CLIENTS + 2];
    for (;;) {
        pfd[0].fd = lfd; pfd[0].events = POLLIN;
        pfd[1].fd = sfd; pfd[1].events = POLLIN;
        for (int i = 0; i < nclients; i++) { pfd[2 + i].fd = clients[i]; pfd[2 + i].events = POLLIN; }
        int r = poll(pfd, (nfds_t)(2 + nclients), -1);
        if (r < 0) { if (errno == EINTR) continue; return 1; }
        if (pfd[1].revents & POLLIN) {
            struct signalfd_siginfo si;
            while (read(sfd, &si, sizeof si) == (ssize_t)sizeof si) {}
            int status;
            pid_t p;
            while ((p = waitpid(-1, &status, WNOHANG)) > 0) on_exit_status(p, status);
        }
        for (int i = nclients - 1; i >= 0; i--)
            if (pfd[2 + i].revents & (POLLIN | POLLHUP | POLLERR)) handle(i);
        if (pfd[0].revents & POLLIN) {
            int c = accept4(lfd, NULL, NULL, SOCK_CLOEXEC);
            if (c >= 0) {
                if (nclients < MAX_CLIENTS) clients[nclients++] = c; else close(c);
            }
        }
    }
}
