/*
 * dsec-reroot: give a running container a new root filesystem, in place (the edge's
 * rollback to an in-place snapshot, docs/snapshots.md).
 *
 *   dsec-reroot INIT_PID NEW_ROOT [ro]
 *
 * NEW_ROOT is an overlay the edge mounted on the host (the same lower layers over a
 * copy of a snapshot's upper dir). This binary enters the container's mount namespace
 * and:
 *   1. attaches a clone of NEW_ROOT on top of the container's root;
 *   2. moves every mount that sits directly on the old root (/proc, /dev with its pts,
 *      shm and mqueue, /sys, tmpfs mounts the sandbox asked for) onto the new one, so
 *      they stay the very same mounts (their contents, the masked /proc paths);
 *   3. pivot_root(".", "."): every process whose root was the old root (dsec-init: the
 *      edge killed the workload first) now has the new one, cwd included;
 *   4. detaches the old root.
 *
 * Why a separate static binary: entering a mount namespace needs a single-threaded
 * process (the edge is not), and a vfork+exec of a small static binary is cheaper than
 * forking the edge. It runs on the host as root and talks to nothing but the kernel.
 * Exit status 0 on success; otherwise the failed step and errno on stderr.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/syscall.h>
#include <unistd.h>

#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif
#ifndef OPEN_TREE_CLONE
#define OPEN_TREE_CLONE 1
#endif
#ifndef MOVE_MOUNT_F_EMPTY_PATH
#define MOVE_MOUNT_F_EMPTY_PATH 0x00000004
#endif
#ifndef MOUNT_ATTR_RDONLY
#define MOUNT_ATTR_RDONLY 0x00000001
#endif

#define MAX_MOUNTS 256

struct mount_attr_s { unsigned long long attr_set, attr_clr, propagation, userns_fd; };

static int fail(const char *step) {
    fprintf(stderr, "dsec-reroot: %s: %s\n", step, strerror(errno));
    return 1;
}

/* mountinfo escapes space, tab, newline and backslash as \ooo */
static void unescape(char *s) {
    char *o = s;
    for (char *p = s; *p; p++) {
        if (p[0] == '\\' && p[1] >= '0' && p[1] <= '7' && p[2] && p[3]) {
            *o++ = (char)((p[1] - '0') * 64 + (p[2] - '0') * 8 + (p[3] - '0'));
            p += 3;
        } else {
            *o++ = *p;
        }
    }
    *o = '\0';
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: dsec-reroot INIT_PID NEW_ROOT [ro]\n"); return 2; }
    const char *pid = argv[1], *new_root = argv[2];
    int readonly = argc > 3 && !strcmp(argv[3], "ro");
    char path[128];

    /* the mounts on the old root, as init sees them (read on the host's /proc: inside, the
       container's /proc has no entry for this process) */
    static char mps[MAX_MOUNTS][512];
    int nmps = 0;
    snprintf(path, sizeof path, "/proc/%s/mountinfo", pid);
    FILE *mi = fopen(path, "re");
    if (!mi) return fail("open mountinfo");
    static char line[8192];
    long root_id = -1;
    static long ids[4096], parents[4096];
    static char points[4096][512];
    int n = 0;
    while (fgets(line, sizeof line, mi) && n < 4096) {
        char mp[4096];
        if (sscanf(line, "%ld %ld %*s %*s %4095s", &ids[n], &parents[n], mp) != 3) continue;
        unescape(mp);
        if (strlen(mp) >= sizeof points[0]) continue;
        strcpy(points[n], mp);
        if (!strcmp(mp, "/")) root_id = ids[n];
        n++;
    }
    fclose(mi);
    if (root_id < 0) { errno = ENOENT; return fail("find the root mount"); }
    for (int i = 0; i < n && nmps < MAX_MOUNTS; i++)
        if (parents[i] == root_id && ids[i] != root_id && strcmp(points[i], "/")) strcpy(mps[nmps++], points[i]);

    int tree = (int)syscall(SYS_open_tree, AT_FDCWD, new_root, OPEN_TREE_CLONE | O_CLOEXEC);
    if (tree < 0) return fail("open_tree NEW_ROOT");
    /* a clone of a shared host mount joins its peer group: private, so nothing mounted on the
     * sandbox's new root shows on the host and nothing the host mounts there reaches the sandbox */
    struct mount_attr_s a = { readonly ? MOUNT_ATTR_RDONLY : 0, 0, MS_PRIVATE, 0 };
    if (syscall(SYS_mount_setattr, tree, "", AT_EMPTY_PATH | AT_RECURSIVE, &a, sizeof a) < 0)
        return fail("make it private");
    snprintf(path, sizeof path, "/proc/%s/root", pid);
    int rootfd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (rootfd < 0) return fail("open init's root");
    snprintf(path, sizeof path, "/proc/%s/ns/mnt", pid);
    int ns = open(path, O_RDONLY | O_CLOEXEC);
    if (ns < 0) return fail("open init's mount namespace");
    if (setns(ns, CLONE_NEWNS) < 0) return fail("setns");
    if (fchdir(rootfd) < 0 || chroot(".") < 0) return fail("enter init's root");
    int old = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (old < 0) return fail("open the old root");

    if (syscall(SYS_move_mount, tree, "", AT_FDCWD, "/", MOVE_MOUNT_F_EMPTY_PATH) < 0) return fail("attach NEW_ROOT");
    if (fchdir(tree) < 0) return fail("enter NEW_ROOT");
    for (int i = 0; i < nmps; i++) {
        /* a mount below another one moves with it */
        if (syscall(SYS_move_mount, AT_FDCWD, mps[i], AT_FDCWD, mps[i] + 1, 0) < 0) {
            fprintf(stderr, "dsec-reroot: move %s: %s\n", mps[i], strerror(errno));
            return 1;
        }
    }
    if (syscall(SYS_pivot_root, ".", ".") < 0) return fail("pivot_root");
    if (fchdir(old) < 0) return fail("enter the old root");
    if (mount("", ".", NULL, MS_SLAVE | MS_REC, NULL) < 0) return fail("make the old root a slave");
    if (umount2(".", MNT_DETACH) < 0) return fail("detach the old root");
    return 0;
}
