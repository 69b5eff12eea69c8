/*
 * slurmstepd (remote context): every task of every step of a traced job.
 *
 * init (root):   register the option, so the value forwarded from sbatch/srun
 *                reaches the callback; make the node-local ring base and the
 *                fallback base when absent (root's, mode 0755: nobody else can
 *                make a name in them, so no other user can plant a job's directory).
 * init_post_opt: (root) decide traced or not; make the job's node directory
 *                <local_dir>/job-<id>.<node> and <fallback_dir>/<uid>, each the
 *                job's user's, mode 0700 (the prolog makes them the same way:
 *                whichever comes first), and record the node directory for the epilog.
 * user_init:     (as the job's user) create the job directory; one that is not
 *                the user's own, or that others can write or replace, falls back to
 *                <fallback_dir>/<uid>/megatrace-<id>.
 * task_init:     (as the job's user, per task) the tracer's environment, and
 *                the NCCL interposer in front of LD_PRELOAD (nccl_preload=).
 * task_exit:     (root, per task) the task's exit status, appended to a
 *                root-owned file in run_dir that the epilog hands to the report.
 */
#define _GNU_SOURCE /* renameat2, RTLD_DEFAULT */
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <slurm/slurm.h>

#include "megatrace.h"

#define MT_ENV_MAX (1 << 20) /* no environment value we read is longer than this */

/* A base directory root works in (local_dir, fallback_dir): made root's, mode 0755, when absent. One
 * that exists is left as it is; each name root makes in it is checked (make_user_dir). */
static void ensure_base(const char *dir)
{
	struct stat st;

	if (lstat(dir, &st) < 0 && errno == ENOENT && mkdir(dir, 0755) < 0 && errno != EEXIST)
		mt_debug("mkdir %s: %m", dir);
}

int mt_remote_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	if (mt_register_option(sp) < 0)
		return mt_soft_fail();
	if (geteuid() == 0) {
		ensure_base(mt_state.conf.local_dir);
		ensure_base(mt_state.conf.fallback_dir);
	}
	return 0;
}

/* The job's NAME into buf: 0; absent: -1. A value longer than the buffer is an error (logged), never a
 * truncated value taken as the real one (spank_getenv says ESPANK_NOSPACE). */
static int getenv_job(spank_t sp, const char *name, char *buf, int len)
{
	spank_err_t rc = spank_getenv(sp, name, buf, len);

	if (rc == ESPANK_SUCCESS)
		return 0;
	if (rc == ESPANK_NOSPACE)
		mt_error("%s is longer than %d bytes: ignored", name, len - 1);
	buf[0] = '\0';
	return -1;
}

/* The job's NAME, whatever its length (malloc'd: free it), or NULL: with *err 0 when it is not set, -1
 * when it cannot be read. spank_getenv says ESPANK_NOSPACE until the buffer is large enough. */
static char *getenv_job_dup(spank_t sp, const char *name, int *err)
{
	spank_err_t rc;
	char *buf = NULL, *bigger;

	*err = 0;
	for (int len = 4096; len <= MT_ENV_MAX; len *= 2) {
		if (!(bigger = realloc(buf, (size_t)len)))
			break;
		buf = bigger;
		rc = spank_getenv(sp, name, buf, len);
		if (rc == ESPANK_SUCCESS)
			return buf;
		if (rc == ESPANK_ENV_NOEXIST) {
			free(buf);
			return NULL;
		}
		if (rc != ESPANK_NOSPACE)
			break;
	}
	free(buf);
	*err = -1;
	return NULL;
}

static bool truthy(const char *v)
{
	return *v && strcmp(v, "0") && strcmp(v, "no") && strcmp(v, "false") && strcmp(v, "off");
}

/* Traced? The option (forwarded by sbatch or srun), else the options a traced
 * batch step passed on to srun in its environment, else the submission-time
 * fallback (MEGATRACE / MEGATRACE_OPTS, e.g. for jobs sent through slurmrestd).
 * Decided once per slurmstepd (init_post_opt, or user_init when that did not run). */
static int resolve_traced(spank_t sp)
{
	struct mt_job_opts *opts = &mt_state.opts;
	char buf[MT_OPTS_MAX], err[256] = "";

	if (mt_state.opt_error)
		return -1;
	if (mt_state.resolved)
		return 0;
	mt_state.resolved = true;
	if (!mt_state.opt_seen) {
		if (getenv_job(sp, "MEGATRACE_SPANK_OPTS", buf, sizeof(buf)) == 0 && buf[0]) {
			if (mt_opts_parse(opts, buf, err, sizeof(err)) < 0)
				goto bad;
		} else if (mt_state.conf.env_fallback && getenv_job(sp, "MEGATRACE_OPTS", buf, sizeof(buf)) == 0 &&
			   buf[0]) {
			if (mt_opts_parse(opts, buf, err, sizeof(err)) < 0)
				goto bad;
		} else if (mt_state.conf.env_fallback && getenv_job(sp, "MEGATRACE", buf, sizeof(buf)) == 0 &&
			   truthy(buf)) {
			opts->traced = true;
		}
	}
	if (opts->traced)
		mt_opts_fill_defaults(opts, &mt_state.conf);
	return 0;
bad:
	mt_error("not tracing: invalid options '%.200s': %s", buf, err);
	memset(opts, 0, sizeof(*opts));
	return -1;
}

/* Only names we generate ourselves go into paths: [A-Za-z0-9._-]. */
static void safe_component(char *s)
{
	for (; *s; s++)
		if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
		      *s == '.' || *s == '_' || *s == '-'))
			*s = '_';
}

/* This node's name as a path component (SLURMD_NODENAME; the host name without it). */
static void node_name(spank_t sp, char *node, size_t len)
{
	if (getenv_job(sp, "SLURMD_NODENAME", node, (int)len) < 0 || !node[0])
		gethostname(node, len - 1);
	node[len - 1] = '\0';
	safe_component(node);
	if (!node[0] || !strcmp(node, ".") || !strcmp(node, ".."))
		mt_snprintf(node, len, "node");
}

/* This node's name in a root hook before the tasks. slurmstepd sets SLURMD_NODENAME only just before
 * task_init (a value in the job's environment now is the batch script's, of another node), so take the
 * step's node list (SLURM_STEP_NODELIST, set by srun; the job's for the batch step) at this node's index
 * (S_JOB_NODEID), expanded by libslurm's hostlist functions when slurmstepd has them. 0, or -1 when the
 * name cannot be known: then nothing is made under a guessed name. */
static int node_name_early(spank_t sp, uint32_t step_id, char *node, size_t len)
{
	void *(*create)(const char *) = (void *(*)(const char *))dlsym(RTLD_DEFAULT, "slurm_hostlist_create");
	char *(*shift)(void *) = (char *(*)(void *))dlsym(RTLD_DEFAULT, "slurm_hostlist_shift");
	void (*destroy)(void *) = (void (*)(void *))dlsym(RTLD_DEFAULT, "slurm_hostlist_destroy");
	char *list, *host = NULL;
	void *hl;
	uint32_t id = 0;
	int err, rc = -1;

	if (!create || !shift || !destroy || spank_get_item(sp, S_JOB_NODEID, &id) != ESPANK_SUCCESS)
		return -1;
	list = getenv_job_dup(sp, step_id == SLURM_BATCH_SCRIPT ? "SLURM_JOB_NODELIST" : "SLURM_STEP_NODELIST", &err);
	hl = list && list[0] ? create(list) : NULL;
	for (uint32_t k = 0; hl && k <= id; k++) {
		free(host);
		if (!(host = shift(hl)))
			break;
	}
	if (host && mt_snprintf(node, len, "%s", host) == 0) {
		safe_component(node);
		rc = 0;
	}
	free(host);
	if (hl)
		destroy(hl);
	free(list);
	return rc;
}

/* run_dir must be root's and writable by nobody else: the files written there are trusted by the epilog. */
static bool safe_run_dir(const char *dir)
{
	struct stat st;

	if (lstat(dir, &st) < 0 && errno == ENOENT && mkdir(dir, 0755) < 0)
		return false;
	return lstat(dir, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == 0 && !(st.st_mode & 022);
}

/* <parent>/<name>: a directory of uid:gid, mode 0700, made by root (slurmstepd before it drops
 * privileges, or the prolog). Made under a temporary name and renamed into place without replacing
 * anything, so that nobody sees it half made; the prolog or another step's slurmstepd may have made it
 * first: then it is checked. Returns 0 when it is there and the user's. */
static int make_user_dir(const char *parent, const char *name, uid_t uid, gid_t gid)
{
	char tmp[320];
	struct stat st;
	int pfd = open(parent, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC), rc = -1;

	if (pfd < 0 || fstat(pfd, &st) < 0 || st.st_uid != 0) {
		mt_error("%s is not a directory of root's: the job's directories are not made in it", parent);
		goto out;
	}
	for (int attempt = 0; attempt < 50; attempt++) {
		if (fstatat(pfd, name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
			if (S_ISDIR(st.st_mode) && st.st_uid == uid && !(st.st_mode & 077)) {
				rc = 0;
				goto out;
			}
			if (S_ISDIR(st.st_mode) && st.st_uid == 0 && uid != 0) { /* the prolog, between mkdir and chown */
				usleep(20000);
				continue;
			}
			mt_error("%s/%s exists and is not the job's user's private directory (uid %u, mode %04o): not used",
				 parent, name, (unsigned)st.st_uid, (unsigned)(st.st_mode & 07777));
			goto out;
		}
		if (mt_snprintf(tmp, sizeof(tmp), ".%.250s.%ld", name, (long)getpid()) < 0)
			goto out;
		if (mkdirat(pfd, tmp, 0700) < 0) {
			mt_error("mkdir %s/%s: %m", parent, tmp);
			goto out;
		}
		if (fchownat(pfd, tmp, uid, gid, AT_SYMLINK_NOFOLLOW) < 0 || fchmodat(pfd, tmp, 0700, 0) < 0) {
			mt_error("chown %s/%s: %m", parent, tmp);
			unlinkat(pfd, tmp, AT_REMOVEDIR);
			goto out;
		}
		if (renameat2(pfd, tmp, pfd, name, RENAME_NOREPLACE) == 0) {
			rc = 0;
			goto out;
		}
		if (errno != EEXIST) {
			mt_error("rename %s/%s: %m", parent, tmp);
			unlinkat(pfd, tmp, AT_REMOVEDIR);
			goto out;
		}
		unlinkat(pfd, tmp, AT_REMOVEDIR); /* made meanwhile by someone else: look at it again */
	}
out:
	if (pfd >= 0)
		close(pfd);
	return rc;
}

/* A one-line root-owned file in run_dir (the epilog trusts only those). */
static void record(const char *path, const char *line)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644), n = (int)strlen(line);

	if (fd < 0) {
		mt_debug("open %s: %m", path);
		return;
	}
	if (write(fd, line, (size_t)n) != n)
		mt_debug("write %s: %m", path);
	close(fd);
}

/* Root, before privileges are dropped: the job's directories that only root can make. */
int mt_remote_post_opt(spank_t sp, int ac, char **av)
{
	char node[256] = "", name[320], uid_name[32], path[MT_PATH_MAX], line[MT_PATH_MAX + 2];
	uint32_t job_id = 0, step_id = 0;
	uid_t uid;
	gid_t gid;

	(void)ac;
	(void)av;
	if (resolve_traced(sp) < 0)
		return mt_soft_fail();
	if (!mt_state.opts.traced || geteuid() != 0)
		return 0;
	if (spank_get_item(sp, S_JOB_STEPID, &step_id) == ESPANK_SUCCESS && step_id == SLURM_EXTERN_CONT)
		return 0; /* the job's extern step runs no tasks of the user's */
	if (spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_UID, &uid) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_GID, &gid) != ESPANK_SUCCESS) {
		mt_error("cannot get the job's id and user");
		return mt_soft_fail();
	}
	if (node_name_early(sp, step_id, node, sizeof(node)) < 0) {
		mt_debug("this node's name is not known yet: its directories are left to the prolog");
		return 0;
	}
	mt_snprintf(uid_name, sizeof(uid_name), "%u", (unsigned)uid);
	if (mt_snprintf(name, sizeof(name), "job-%" PRIu32 ".%s", job_id, node) < 0)
		return mt_soft_fail();
	ensure_base(mt_state.conf.fallback_dir);
	if (make_user_dir(mt_state.conf.fallback_dir, uid_name, uid, gid) < 0)
		mt_error("no fallback directory for uid %u in %s", (unsigned)uid, mt_state.conf.fallback_dir);
	ensure_base(mt_state.conf.local_dir);
	if (make_user_dir(mt_state.conf.local_dir, name, uid, gid) < 0) {
		mt_error("no node directory %s/%s: the tracer will refuse to write this node's rings",
			 mt_state.conf.local_dir, name);
		return mt_soft_fail();
	}
	/* The epilog copies and removes a node directory only when this record (or the prolog's) names it. */
	if (safe_run_dir(mt_state.conf.run_dir) &&
	    mt_snprintf(path, sizeof(path), "%s/nodedir-%" PRIu32 ".%s", mt_state.conf.run_dir, job_id, node) == 0 &&
	    mt_snprintf(line, sizeof(line), "%s/%s\n", mt_state.conf.local_dir, name) == 0)
		record(path, line);
	return 0;
}

/* mkdir -p PATH (as the job's user); then PATH must be a real directory this user owns that others cannot
 * write, in a parent that others cannot write either unless it is sticky (like /tmp): a directory someone
 * else made first, or could swap, is never used (*why says what is wrong). */
static int own_dir_p(const char *path, mode_t mode, const char **why)
{
	char tmp[MT_PATH_MAX];
	struct stat st;
	int fd, up;

	*why = "cannot be created";
	if (mt_snprintf(tmp, sizeof(tmp), "%s", path) < 0)
		return -1;
	for (char *p = tmp + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = '\0';
		if (mkdir(tmp, mode) < 0 && errno != EEXIST)
			return -1;
		*p = '/';
	}
	if (mkdir(tmp, mode) < 0 && errno != EEXIST)
		return -1;
	*why = "is a symbolic link or not a directory";
	if ((fd = open(tmp, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)) < 0)
		return -1;
	*why = "belongs to another user";
	if (fstat(fd, &st) < 0 || st.st_uid != geteuid())
		goto bad;
	*why = "is writable by other users";
	if (st.st_mode & 022)
		goto bad;
	*why = "is in a directory another user can change";
	up = openat(fd, "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
	if (up < 0)
		goto bad;
	if (fstat(up, &st) < 0 || (st.st_uid != 0 && st.st_uid != geteuid()) ||
	    ((st.st_mode & S_IWOTH) && !(st.st_mode & S_ISVTX))) {
		close(up);
		goto bad;
	}
	close(up);
	close(fd);
	return 0;
bad:
	close(fd);
	return -1;
}

int mt_remote_user_init(spank_t sp, int ac, char **av)
{
	struct mt_job_opts *opts = &mt_state.opts;
	char submit[MT_PATH_MAX] = "", restarts[16] = "", fallback[MT_PATH_MAX];
	const char *why = "", *why2 = "";
	uint32_t job_id = 0;

	(void)ac;
	(void)av;
	if (resolve_traced(sp) < 0)
		return mt_soft_fail();
	if (!opts->traced)
		return 0;
	if (spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS) {
		mt_error("cannot get the job id");
		return mt_soft_fail();
	}
	getenv_job(sp, "SLURM_SUBMIT_DIR", submit, sizeof(submit));
	if (opts->dir[0] == '/') {
		if (mt_snprintf(mt_state.job_dir, sizeof(mt_state.job_dir), "%s", opts->dir) < 0)
			goto toolong;
	} else if (opts->dir[0]) {
		if (mt_snprintf(mt_state.job_dir, sizeof(mt_state.job_dir), "%s/%s", submit[0] ? submit : ".",
				opts->dir) < 0)
			goto toolong;
	} else if (mt_snprintf(mt_state.job_dir, sizeof(mt_state.job_dir), "%s/megatrace-%" PRIu32,
			       submit[0] ? submit : ".", job_id) < 0) {
		goto toolong;
	}
	/* A requeued job (same id) gets a directory of its own per attempt: <dir>.r<restarts>. */
	if (getenv_job(sp, "SLURM_RESTART_COUNT", restarts, sizeof(restarts)) == 0 && restarts[0] &&
	    strspn(restarts, "0123456789") == strlen(restarts) && strcmp(restarts, "0")) {
		size_t used = strlen(mt_state.job_dir);

		if (mt_snprintf(mt_state.job_dir + used, sizeof(mt_state.job_dir) - used, ".r%s", restarts) < 0)
			goto toolong;
	}
	/* We run as the job's user here: the directory and everything in it is theirs, and only theirs. */
	if (own_dir_p(mt_state.job_dir, 0755, &why) == 0)
		return 0;
	/* <fallback_dir>/<uid> was made for this user by root (init_post_opt, or the prolog). */
	if (mt_snprintf(fallback, sizeof(fallback), "%s/%u/megatrace-%" PRIu32, mt_state.conf.fallback_dir,
			(unsigned)geteuid(), job_id) < 0 || own_dir_p(fallback, 0700, &why2) < 0) {
		mt_error("job directory %s %s, and %s %s: traces stay on the nodes", mt_state.job_dir, why, fallback,
			 why2);
		mt_state.job_dir[0] = '\0';
		return mt_soft_fail();
	}
	mt_error("job directory %s %s: using %s", mt_state.job_dir, why, fallback);
	mt_snprintf(mt_state.job_dir, sizeof(mt_state.job_dir), "%s", fallback);
	return 0;
toolong:
	mt_error("job directory path too long");
	mt_state.job_dir[0] = '\0';
	return mt_soft_fail();
}

static void step_name(uint32_t step_id, char *buf, size_t len)
{
	if (step_id == SLURM_BATCH_SCRIPT)
		mt_snprintf(buf, len, "batch");
	else if (step_id == SLURM_EXTERN_CONT)
		mt_snprintf(buf, len, "extern");
	else if (step_id == SLURM_INTERACTIVE_STEP)
		mt_snprintf(buf, len, "interactive");
	else
		mt_snprintf(buf, len, "%" PRIu32, step_id);
}

static int preload_interposer(spank_t sp);

int mt_remote_task_init(spank_t sp, int ac, char **av)
{
	struct mt_job_opts *opts = &mt_state.opts;
	char node[256] = "", step[32], job[32], ring_dir[MT_PATH_MAX], text[MT_OPTS_MAX], secs[32];
	uint32_t job_id = 0, step_id = 0;

	(void)ac;
	(void)av;
	if (!opts->traced)
		return 0;
	if (spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_STEPID, &step_id) != ESPANK_SUCCESS) {
		mt_error("cannot get the job and step ids");
		return mt_soft_fail();
	}
	node_name(sp, node, sizeof(node));
	step_name(step_id, step, sizeof(step));
	mt_snprintf(job, sizeof(job), "%" PRIu32, job_id);
	mt_snprintf(secs, sizeof(secs), "%ld", opts->hang_timeout);
	/* Node-local rings, one directory per node and step; the epilog copies
	 * them into the job directory if the collector could not. */
	if (mt_snprintf(ring_dir, sizeof(ring_dir), "%s/job-%s.%s/step-%s", mt_state.conf.local_dir, job, node,
			step) < 0 || mt_opts_format(opts, text, sizeof(text)) < 0) {
		mt_error("ring directory path too long");
		return mt_soft_fail();
	}
	if (spank_setenv(sp, "MEGATRACE_ENABLE", "1", 1) != ESPANK_SUCCESS ||
	    spank_setenv(sp, "MEGATRACE_DIR", ring_dir, 1) != ESPANK_SUCCESS ||
	    spank_setenv(sp, "MEGATRACE_JOB_ID", job, 1) != ESPANK_SUCCESS ||
	    spank_setenv(sp, "MEGATRACE_STEP_ID", step, 1) != ESPANK_SUCCESS ||
	    spank_setenv(sp, "MEGATRACE_HANG_TIMEOUT", secs, 1) != ESPANK_SUCCESS ||
	    spank_setenv(sp, "MEGATRACE_ON_HANG", mt_on_hang_name(opts->on_hang), 1) != ESPANK_SUCCESS ||
	    spank_setenv(sp, "MEGATRACE_CHECK", mt_check_name(opts->check), 1) != ESPANK_SUCCESS ||
	    spank_setenv(sp, "MEGATRACE_SPANK_OPTS", text, 1) != ESPANK_SUCCESS ||
	    spank_setenv(sp, "MEGATRACE_BIN", mt_state.conf.megatrace, 1) != ESPANK_SUCCESS ||
	    (mt_state.job_dir[0] &&
	     spank_setenv(sp, "MEGATRACE_OUT_DIR", mt_state.job_dir, 1) != ESPANK_SUCCESS)) {
		mt_error("cannot set the tracer's environment");
		return mt_soft_fail();
	}
	return preload_interposer(sp);
}

/* nccl_preload=PATH: PATH first in the task's LD_PRELOAD, so that a framework's
 * own NCCL calls are traced too (the interposer passes every call through). The
 * user's own LD_PRELOAD is kept whole, however long it is. */
static int preload_interposer(spank_t sp)
{
	const char *lib = mt_state.conf.nccl_preload;
	char *old, *value;
	size_t len;
	int err, rc = 0;

	if (!lib[0])
		return 0;
	if (access(lib, R_OK) < 0) {
		mt_error("nccl_preload %s is not readable: NCCL calls are not traced", lib);
		return mt_soft_fail();
	}
	old = getenv_job_dup(sp, "LD_PRELOAD", &err);
	if (err < 0) {
		mt_error("cannot read the job's LD_PRELOAD (longer than %d bytes?): left as it is, NCCL calls are "
			 "not traced", MT_ENV_MAX);
		return mt_soft_fail();
	}
	if (old && strstr(old, lib)) {
		free(old);
		return 0;
	}
	len = strlen(lib) + (old ? strlen(old) + 1 : 0) + 1;
	if (!(value = malloc(len))) {
		free(old);
		mt_error("cannot set LD_PRELOAD: out of memory");
		return mt_soft_fail();
	}
	if (old && old[0])
		snprintf(value, len, "%s:%s", lib, old);
	else
		snprintf(value, len, "%s", lib);
	if (spank_setenv(sp, "LD_PRELOAD", value, 1) != ESPANK_SUCCESS) {
		mt_error("cannot set LD_PRELOAD");
		rc = mt_soft_fail();
	}
	free(value);
	free(old);
	return rc;
}

int mt_remote_task_exit(spank_t sp, int ac, char **av)
{
	uint32_t job_id = 0, step_id = 0, rank = 0;
	pid_t pid = 0;
	int status = 0, fd, n;
	char node[256] = "", step[32], path[MT_PATH_MAX], line[256];
	struct timespec now;

	(void)ac;
	(void)av;
	if (!mt_state.opts.traced || geteuid() != 0)
		return 0;
	if (spank_get_item(sp, S_JOB_ID, &job_id) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_JOB_STEPID, &step_id) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_TASK_GLOBAL_ID, &rank) != ESPANK_SUCCESS ||
	    spank_get_item(sp, S_TASK_EXIT_STATUS, &status) != ESPANK_SUCCESS)
		return 0;
	spank_get_item(sp, S_TASK_PID, &pid);
	clock_gettime(CLOCK_REALTIME, &now);
	node_name(sp, node, sizeof(node));
	step_name(step_id, step, sizeof(step));
	if (!safe_run_dir(mt_state.conf.run_dir) ||
	    mt_snprintf(path, sizeof(path), "%s/exits-%" PRIu32 ".%s", mt_state.conf.run_dir, job_id, node) < 0) {
		mt_debug("run_dir %s unusable: task exit not recorded", mt_state.conf.run_dir);
		return 0;
	}
	if (mt_snprintf(line, sizeof(line), "step=%s rank=%" PRIu32 " pid=%ld status=%d wall_ns=%lld\n", step, rank,
			(long)pid, status, (long long)now.tv_sec * 1000000000LL + now.tv_nsec) < 0)
		return 0;
	n = (int)strlen(line);
	fd = open(path, O_WRONLY | O_CREAT | O_APPEND | O_NOFOLLOW | O_CLOEXEC, 0640);
	if (fd < 0) {
		mt_debug("open %s: %m", path);
		return 0;
	}
	if (write(fd, line, (size_t)n) != n) /* one small O_APPEND write: lines never interleave */
		mt_debug("write %s: %m", path);
	close(fd);
	return 0;
}
