/*
 * slurmstepd (remote context): every task of every step of a traced job.
 *
 * init (root):   register the option, so the value forwarded from sbatch/srun
 *                reaches the callback; make sure the node-local ring base exists.
 * user_init:     (as the job's user) decide traced or not, create the job
 *                directory; an unwritable one falls back to fallback_dir.
 * task_init:     (as the job's user, per task) the tracer's environment, and
 *                the NCCL interposer in front of LD_PRELOAD (nccl_preload=).
 * task_exit:     (root, per task) the task's exit status, appended to a
 *                root-owned file in run_dir that the epilog hands to the report.
 */
#include <errno.h>
#include <fcntl.h>
#include <time.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include <slurm/slurm.h>

#include "megatrace.h"

int mt_remote_init(spank_t sp, int ac, char **av)
{
	struct stat st;

	(void)ac;
	(void)av;
	if (mt_register_option(sp) < 0)
		return mt_soft_fail();
	/* The base of the node-local ring directories: root-owned, sticky and
	 * world-writable like /tmp, so every user creates (and owns) their own. */
	if (geteuid() == 0 && lstat(mt_state.conf.local_dir, &st) < 0 && errno == ENOENT) {
		/* chmod (the umask) only what this mkdir created: root's, in a sticky
		 * parent, so nobody can swap it for a symlink in between. Anything that
		 * already exists is left alone (the prolog refuses a base not root's). */
		if (mkdir(mt_state.conf.local_dir, 01777) < 0)
			mt_debug("mkdir %s: %m", mt_state.conf.local_dir);
		else if (chmod(mt_state.conf.local_dir, 01777) < 0)
			mt_debug("chmod %s: %m", mt_state.conf.local_dir);
	}
	return 0;
}

static int getenv_job(spank_t sp, const char *name, char *buf, int len)
{
	return spank_getenv(sp, name, buf, len) == ESPANK_SUCCESS ? 0 : -1;
}

static bool truthy(const char *v)
{
	return *v && strcmp(v, "0") && strcmp(v, "no") && strcmp(v, "false") && strcmp(v, "off");
}

/* Traced? The option (forwarded by sbatch or srun), else the options a traced
 * batch step passed on to srun in its environment, else the submission-time
 * fallback (MEGATRACE / MEGATRACE_OPTS, e.g. for jobs sent through slurmrestd). */
static int resolve_traced(spank_t sp)
{
	struct mt_job_opts *opts = &mt_state.opts;
	char buf[MT_OPTS_MAX], err[256] = "";

	if (mt_state.opt_error)
		return -1;
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

static int mkdir_p(const char *path, mode_t mode)
{
	char tmp[MT_PATH_MAX];
	struct stat st;

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
	if (stat(tmp, &st) < 0 || !S_ISDIR(st.st_mode) || access(tmp, W_OK | X_OK) < 0)
		return -1;
	return 0;
}

int mt_remote_user_init(spank_t sp, int ac, char **av)
{
	struct mt_job_opts *opts = &mt_state.opts;
	char submit[MT_PATH_MAX] = "", restarts[16] = "";
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
	/* We run as the job's user here: the directory and everything in it is theirs. */
	if (mkdir_p(mt_state.job_dir, 0755) < 0) {
		char fallback[MT_PATH_MAX];

		if (mt_snprintf(fallback, sizeof(fallback), "%s/megatrace-%" PRIu32, mt_state.conf.fallback_dir,
				job_id) < 0 || mkdir_p(fallback, 0755) < 0) {
			mt_error("job directory %s is not writable and neither is %s: traces stay on the nodes",
				 mt_state.job_dir, fallback);
			mt_state.job_dir[0] = '\0';
			return mt_soft_fail();
		}
		mt_error("job directory %s is not writable: using %s", mt_state.job_dir, fallback);
		mt_snprintf(mt_state.job_dir, sizeof(mt_state.job_dir), "%s", fallback);
	}
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

/* Only names we generate ourselves go into paths: [A-Za-z0-9._-]. */
static void safe_component(char *s)
{
	for (; *s; s++)
		if (!((*s >= 'a' && *s <= 'z') || (*s >= 'A' && *s <= 'Z') || (*s >= '0' && *s <= '9') ||
		      *s == '.' || *s == '_' || *s == '-'))
			*s = '_';
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
	if (getenv_job(sp, "SLURMD_NODENAME", node, sizeof(node)) < 0 || !node[0])
		gethostname(node, sizeof(node) - 1);
	safe_component(node);
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
 * own NCCL calls are traced too (the interposer passes every call through). */
static int preload_interposer(spank_t sp)
{
	const char *lib = mt_state.conf.nccl_preload;
	char old[MT_OPTS_MAX] = "", value[MT_OPTS_MAX + MT_PATH_MAX];

	if (!lib[0])
		return 0;
	if (access(lib, R_OK) < 0) {
		mt_error("nccl_preload %s is not readable: NCCL calls are not traced", lib);
		return mt_soft_fail();
	}
	if (getenv_job(sp, "LD_PRELOAD", old, sizeof(old)) == 0 && old[0]) {
		if (strstr(old, lib))
			return 0;
		if (mt_snprintf(value, sizeof(value), "%s:%s", lib, old) < 0) {
			mt_error("LD_PRELOAD too long to add %s", lib);
			return mt_soft_fail();
		}
	} else {
		mt_snprintf(value, sizeof(value), "%s", lib);
	}
	if (spank_setenv(sp, "LD_PRELOAD", value, 1) != ESPANK_SUCCESS) {
		mt_error("cannot set LD_PRELOAD");
		return mt_soft_fail();
	}
	return 0;
}

/* run_dir must be root's and writable by nobody else: the file written there is trusted by the epilog. */
static bool safe_run_dir(const char *dir)
{
	struct stat st;

	if (lstat(dir, &st) < 0 && errno == ENOENT && mkdir(dir, 0755) < 0)
		return false;
	return lstat(dir, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == 0 && !(st.st_mode & 022);
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
	if (getenv_job(sp, "SLURMD_NODENAME", node, sizeof(node)) < 0 || !node[0])
		gethostname(node, sizeof(node) - 1);
	safe_component(node);
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
