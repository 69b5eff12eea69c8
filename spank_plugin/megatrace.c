/*
 * MegaTrace SPANK plugin: entry points and dispatch per SPANK context.
 *
 *   sbatch / salloc (allocator) and srun (local)  -> local.c
 *   slurmstepd (remote)                            -> remote.c
 *
 * Jobs without --megatrace (and without the MEGATRACE / MEGATRACE_OPTS
 * submission fallback) are never touched. Plugin failures are logged and the job
 * goes on, unless the site passes strict=1 on the plugstack line.
 */
#include <string.h>

#include "megatrace.h"

SPANK_PLUGIN(megatrace, 1);

struct mt_state mt_state;

static int opt_cb(int val, const char *optarg, int remote);

static struct spank_option mt_option = {
	.name = "megatrace",
	.arginfo = "[key=value,...]",
	.usage = "megatrace: trace every task of the job with MegaTrace. Keys: "
		 "hang-timeout=SECONDS, dir=PATH (default: $SLURM_SUBMIT_DIR/megatrace-<jobid>), "
		 "on-hang=report|cancel|requeue, check=off|quick|full",
	.has_arg = 2, /* the value is optional */
	.val = 0,
	.cb = opt_cb,
};

static int opt_cb(int val, const char *optarg, int remote)
{
	char err[256] = "";

	(void)val;
	/* The last occurrence wins. slurmstepd may deliver the value twice (from
	 * the job's environment and from srun's forwarded options). */
	memset(&mt_state.opts, 0, sizeof(mt_state.opts));
	mt_state.opt_error = 0;
	mt_state.opt_seen = true;
	/* Slurm bug (22.05): sbatch exports a bare --megatrace (optional value
	 * absent) to the job as the string "(null)", which srun then passes back
	 * here. Treat it as no value. */
	if (optarg && strcmp(optarg, "(null)") == 0)
		optarg = NULL;
	if (mt_opts_parse(&mt_state.opts, optarg, err, sizeof(err)) < 0) {
		mt_error("invalid --megatrace=%.200s: %s", optarg ? optarg : "", err);
		memset(&mt_state.opts, 0, sizeof(mt_state.opts));
		mt_state.opt_error = -1;
		/* Rejecting the option rejects the submission (allocator and local
		 * contexts); in slurmstepd the job was accepted already. */
		return remote ? mt_soft_fail() : -1;
	}
	return 0;
}

int mt_register_option(spank_t sp)
{
	/* sbatch shows an option only when it is registered here, in
	 * slurm_spank_init; a static spank_options[] table reaches srun only. */
	if (spank_option_register(sp, &mt_option) != ESPANK_SUCCESS) {
		mt_error("cannot register the --megatrace option");
		return -1;
	}
	return 0;
}

int mt_soft_fail(void)
{
	return mt_state.conf.strict ? -1 : 0;
}

int slurm_spank_init(spank_t sp, int ac, char **av)
{
	memset(&mt_state, 0, sizeof(mt_state));
	if (mt_conf_parse(&mt_state.conf, ac, av) < 0)
		return mt_soft_fail();

	switch (spank_context()) {
	case S_CTX_LOCAL:
	case S_CTX_ALLOCATOR:
		return mt_local_init(sp, ac, av);
	case S_CTX_REMOTE:
		return mt_remote_init(sp, ac, av);
	default:
		return 0;
	}
}

int slurm_spank_init_post_opt(spank_t sp, int ac, char **av)
{
	switch (spank_context()) {
	case S_CTX_LOCAL:
	case S_CTX_ALLOCATOR:
		return mt_local_post_opt(sp, ac, av);
	case S_CTX_REMOTE:
		return mt_remote_post_opt(sp, ac, av);
	default:
		return 0;
	}
}

int slurm_spank_user_init(spank_t sp, int ac, char **av)
{
	if (spank_context() != S_CTX_REMOTE)
		return 0;
	return mt_remote_user_init(sp, ac, av);
}

int slurm_spank_task_init(spank_t sp, int ac, char **av)
{
	if (spank_context() != S_CTX_REMOTE)
		return 0;
	return mt_remote_task_init(sp, ac, av);
}

int slurm_spank_task_exit(spank_t sp, int ac, char **av)
{
	if (spank_context() != S_CTX_REMOTE)
		return 0;
	return mt_remote_task_exit(sp, ac, av);
}

int slurm_spank_exit(spank_t sp, int ac, char **av)
{
	(void)sp;
	(void)ac;
	(void)av;
	memset(&mt_state, 0, sizeof(mt_state));
	return 0;
}
