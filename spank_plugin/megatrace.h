/*
 * MegaTrace SPANK plugin: shared declarations.
 *
 * One option (--megatrace[=key=value,...]) on sbatch, salloc and srun; site
 * defaults from the plugstack line; one static state struct per process.
 */
#ifndef MEGATRACE_SPANK_H
#define MEGATRACE_SPANK_H

#include <stdbool.h>
#include <stddef.h>
#include <slurm/spank.h>

#define MT_NAME "megatrace"
#define MT_PATH_MAX 4096
#define MT_OPTS_MAX 8192
#define MT_HANG_TIMEOUT_MAX 604800 /* one week */

/* Log helpers: every line starts with the plugin's name. */
#define mt_error(fmt, ...) slurm_error(MT_NAME ": " fmt, ##__VA_ARGS__)
#define mt_info(fmt, ...) slurm_info(MT_NAME ": " fmt, ##__VA_ARGS__)
#define mt_verbose(fmt, ...) slurm_verbose(MT_NAME ": " fmt, ##__VA_ARGS__)
#define mt_debug(fmt, ...) slurm_debug(MT_NAME ": " fmt, ##__VA_ARGS__)

enum mt_on_hang { MT_ON_HANG_UNSET = 0, MT_ON_HANG_REPORT, MT_ON_HANG_CANCEL, MT_ON_HANG_REQUEUE };
enum mt_check { MT_CHECK_UNSET = 0, MT_CHECK_OFF, MT_CHECK_QUICK, MT_CHECK_FULL };

/* The user's choices; fields start unset (0 / "") so that site defaults and the
 * environment fallback fill only what the user did not give. */
struct mt_job_opts {
	bool traced;
	long hang_timeout; /* seconds; 0 = unset */
	char dir[MT_PATH_MAX]; /* "" = unset */
	enum mt_on_hang on_hang;
	enum mt_check check;
};

/* Site configuration: the plugstack.conf arguments. */
struct mt_site_conf {
	char megatrace[MT_PATH_MAX]; /* the megatrace executable */
	char local_dir[MT_PATH_MAX]; /* node-local ring directory base */
	char fallback_dir[MT_PATH_MAX]; /* root's: <fallback_dir>/<uid>/megatrace-<id> when the job dir is unusable */
	char run_dir[MT_PATH_MAX]; /* root-owned: task exit statuses for the epilog */
	char nccl_preload[MT_PATH_MAX]; /* the NCCL interposer, put in front of each task's LD_PRELOAD */
	long hang_timeout;
	enum mt_on_hang on_hang;
	enum mt_check check;
	bool strict; /* plugin errors fail the job */
	bool env_fallback; /* honour MEGATRACE=1 / MEGATRACE_OPTS at submission */
};

/* opts.c */
int mt_conf_parse(struct mt_site_conf *conf, int ac, char **av);
int mt_opts_parse(struct mt_job_opts *opts, const char *text, char *err, size_t errlen);
void mt_opts_fill_defaults(struct mt_job_opts *opts, const struct mt_site_conf *conf);
int mt_opts_format(const struct mt_job_opts *opts, char *buf, size_t len);
const char *mt_on_hang_name(enum mt_on_hang v);
const char *mt_check_name(enum mt_check v);
int mt_snprintf(char *buf, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* local.c: sbatch, salloc (allocator context) and srun (local context) */
int mt_local_init(spank_t sp, int ac, char **av);
int mt_local_post_opt(spank_t sp, int ac, char **av);

/* remote.c: slurmstepd */
int mt_remote_init(spank_t sp, int ac, char **av);
int mt_remote_post_opt(spank_t sp, int ac, char **av);
int mt_remote_user_init(spank_t sp, int ac, char **av);
int mt_remote_task_init(spank_t sp, int ac, char **av);
int mt_remote_task_exit(spank_t sp, int ac, char **av);

/* megatrace.c: the state shared by the context files of one process */
struct mt_state {
	struct mt_site_conf conf;
	struct mt_job_opts opts;
	bool opt_seen; /* the --megatrace callback ran */
	bool resolved; /* remote: traced or not is decided (init_post_opt, else user_init) */
	int opt_error; /* a bad option seen in a hook whose errors Slurm drops */
	char job_dir[MT_PATH_MAX];
};
extern struct mt_state mt_state;
int mt_register_option(spank_t sp);
/* What the plugin returns for its own failures: -1 only when the site asked for it. */
int mt_soft_fail(void);

#endif
