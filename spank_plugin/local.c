/*
 * sbatch and salloc (allocator context), srun (local context).
 *
 * After the options: apply the submission-time environment fallback
 * (MEGATRACE=1 or MEGATRACE_OPTS=key=value,...), fill the site defaults and tell
 * the prolog and epilog that the job is traced (job control environment: they
 * see SPANK_MEGATRACE_ENABLE, SPANK_MEGATRACE_OPTS, SPANK_MEGATRACE_SUBMIT_DIR).
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "megatrace.h"

int mt_local_init(spank_t sp, int ac, char **av)
{
	(void)ac;
	(void)av;
	return mt_register_option(sp) < 0 ? mt_soft_fail() : 0;
}

static bool truthy(const char *v)
{
	return v && *v && strcmp(v, "0") && strcmp(v, "no") && strcmp(v, "false") && strcmp(v, "off");
}

int mt_local_post_opt(spank_t sp, int ac, char **av)
{
	struct mt_job_opts *opts = &mt_state.opts;
	char err[256] = "";
	char text[MT_OPTS_MAX];
	char cwd[MT_PATH_MAX];
	const char *env_opts;
	int rc = -1;

	(void)ac;
	(void)av;
	if (mt_state.opt_error)
		return -1;
	if (!mt_state.opt_seen && mt_state.conf.env_fallback) {
		env_opts = getenv("MEGATRACE_OPTS");
		if (env_opts && *env_opts) {
			if (mt_opts_parse(opts, env_opts, err, sizeof(err)) < 0) {
				/* Slurm ignores hook errors of optional plugins, so this
				 * cannot reject the submission: say so and do not trace. */
				mt_error("invalid MEGATRACE_OPTS=%.200s: %s; the job is NOT traced", env_opts, err);
				memset(opts, 0, sizeof(*opts));
				return mt_soft_fail();
			}
		} else if (truthy(getenv("MEGATRACE"))) {
			opts->traced = true;
		}
	}
	if (!opts->traced)
		return 0;
	mt_opts_fill_defaults(opts, &mt_state.conf);
	if (!getcwd(cwd, sizeof(cwd)) || mt_opts_format(opts, text, sizeof(text)) < 0) {
		mt_error("cannot describe the job's options: %m");
		goto fail;
	}
	/* The job control environment exists only while an allocation is made:
	 * always for sbatch and salloc, for srun only when it allocates. */
	if (spank_job_control_setenv(sp, "MEGATRACE_ENABLE", "1", 1) != ESPANK_SUCCESS ||
	    spank_job_control_setenv(sp, "MEGATRACE_OPTS", text, 1) != ESPANK_SUCCESS ||
	    spank_job_control_setenv(sp, "MEGATRACE_SUBMIT_DIR", cwd, 1) != ESPANK_SUCCESS) {
		if (spank_context() == S_CTX_ALLOCATOR) {
			mt_error("cannot pass the job's options to the prolog and epilog");
			goto fail;
		}
		mt_debug("srun in an existing allocation: no job control environment");
	}
	mt_verbose("tracing the job (%s)", text);
	rc = 0;
fail:
	return rc == 0 ? 0 : mt_soft_fail();
}
