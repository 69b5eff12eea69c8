/*
 * Parsing: the plugstack arguments (site defaults) and the --megatrace value.
 *
 * Both accept a closed set of key=value pairs and reject unknown keys by name.
 * Every string is copied with bounded, checked formatting.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "megatrace.h"

int mt_snprintf(char *buf, size_t len, const char *fmt, ...)
{
	va_list ap;
	int n;

	va_start(ap, fmt);
	n = vsnprintf(buf, len, fmt, ap);
	va_end(ap);
	if (n < 0 || (size_t)n >= len)
		return -1;
	return 0;
}

static const char *const on_hang_names[] = { "unset", "report", "cancel", "requeue" };
static const char *const check_names[] = { "unset", "off", "quick", "full" };

const char *mt_on_hang_name(enum mt_on_hang v)
{
	return on_hang_names[v];
}

const char *mt_check_name(enum mt_check v)
{
	return check_names[v];
}

static int parse_enum(const char *value, const char *const *names, int n)
{
	for (int i = 1; i < n; i++)
		if (strcmp(value, names[i]) == 0)
			return i;
	return -1;
}

static int parse_seconds(const char *value, long *out)
{
	char *end = NULL;
	long v;

	if (value[0] < '0' || value[0] > '9')
		return -1;
	errno = 0;
	v = strtol(value, &end, 10);
	if (errno || *end != '\0' || v < 1 || v > MT_HANG_TIMEOUT_MAX)
		return -1;
	*out = v;
	return 0;
}

/* A path we will hand to the tracer and to root-run scripts: printable, no
 * separators of our own formats (',' '\n' '='), no dot-dot component. */
static int valid_path(const char *value)
{
	size_t len = strlen(value);

	if (len == 0 || len >= MT_PATH_MAX)
		return -1;
	for (const char *p = value; *p; p++)
		if ((unsigned char)*p < 0x20 || *p == 0x7f || *p == ',' || *p == '=' || *p == '\\')
			return -1;
	if (strcmp(value, "..") == 0 || strncmp(value, "../", 3) == 0 || strstr(value, "/../") ||
	    (len >= 3 && strcmp(value + len - 3, "/..") == 0))
		return -1;
	return 0;
}

static int parse_bool(const char *value, bool *out)
{
	if (!strcmp(value, "1") || !strcmp(value, "yes") || !strcmp(value, "true") || !strcmp(value, "on"))
		*out = true;
	else if (!strcmp(value, "0") || !strcmp(value, "no") || !strcmp(value, "false") || !strcmp(value, "off"))
		*out = false;
	else
		return -1;
	return 0;
}

/* An absolute, valid path argument copied into dst; -1 when it is neither. */
static int copy_abs_path(char *dst, size_t len, const char *value)
{
	if (value[0] != '/' || valid_path(value))
		return -1;
	return mt_snprintf(dst, len, "%s", value);
}

int mt_conf_parse(struct mt_site_conf *conf, int ac, char **av)
{
	int v;

	memset(conf, 0, sizeof(*conf));
	mt_snprintf(conf->megatrace, sizeof(conf->megatrace), "%s", "/usr/local/bin/megatrace");
	mt_snprintf(conf->local_dir, sizeof(conf->local_dir), "%s", "/dev/shm/megatrace");
	mt_snprintf(conf->fallback_dir, sizeof(conf->fallback_dir), "%s", "/var/tmp/megatrace");
	mt_snprintf(conf->run_dir, sizeof(conf->run_dir), "%s", "/run/megatrace");
	conf->hang_timeout = 600;
	conf->on_hang = MT_ON_HANG_REPORT;
	conf->check = MT_CHECK_QUICK;
	conf->strict = false;
	conf->env_fallback = true;

	for (int i = 0; i < ac; i++) {
		const char *arg = av[i];
		const char *eq = strchr(arg, '=');
		const char *value;
		size_t klen;

		if (!eq) {
			mt_error("plugstack argument '%s' is not key=value", arg);
			return -1;
		}
		klen = (size_t)(eq - arg);
		value = eq + 1;
#define KEY(name) (klen == strlen(name) && strncmp(arg, name, klen) == 0)
		if (KEY("megatrace")) {
			if (copy_abs_path(conf->megatrace, sizeof(conf->megatrace), value))
				goto bad;
		} else if (KEY("local_dir")) {
			if (copy_abs_path(conf->local_dir, sizeof(conf->local_dir), value))
				goto bad;
		} else if (KEY("fallback_dir")) {
			if (copy_abs_path(conf->fallback_dir, sizeof(conf->fallback_dir), value))
				goto bad;
		} else if (KEY("run_dir")) {
			if (copy_abs_path(conf->run_dir, sizeof(conf->run_dir), value))
				goto bad;
		} else if (KEY("nccl_preload")) {
			/* one LD_PRELOAD entry: no list separators */
			if (strchr(value, ':') || strchr(value, ' ') ||
			    copy_abs_path(conf->nccl_preload, sizeof(conf->nccl_preload), value))
				goto bad;
		} else if (KEY("hang_timeout")) {
			if (parse_seconds(value, &conf->hang_timeout))
				goto bad;
		} else if (KEY("on_hang")) {
			if ((v = parse_enum(value, on_hang_names, 4)) < 0)
				goto bad;
			conf->on_hang = v;
		} else if (KEY("check")) {
			if ((v = parse_enum(value, check_names, 4)) < 0)
				goto bad;
			conf->check = v;
		} else if (KEY("strict")) {
			if (parse_bool(value, &conf->strict))
				goto bad;
		} else if (KEY("env_fallback")) {
			if (parse_bool(value, &conf->env_fallback))
				goto bad;
		} else {
			mt_error("unknown plugstack argument '%.*s' (known: megatrace, local_dir, fallback_dir, run_dir, "
				 "nccl_preload, hang_timeout, on_hang, check, strict, env_fallback)", (int)klen, arg);
			return -1;
		}
#undef KEY
		continue;
bad:
		mt_error("invalid plugstack argument '%s'", arg);
		return -1;
	}
	return 0;
}

/* Parse "key=value,key=value" into opts (which must start zeroed or hold earlier
 * choices). Empty text means "trace with defaults". On error, err says why. */
int mt_opts_parse(struct mt_job_opts *opts, const char *text, char *err, size_t errlen)
{
	char *copy = NULL, *save = NULL, *item;
	int rc = -1, v;
	long secs;

	opts->traced = true;
	if (!text || !*text)
		return 0;
	if (strlen(text) >= MT_OPTS_MAX) {
		mt_snprintf(err, errlen, "the option value is longer than %d bytes", MT_OPTS_MAX - 1);
		return -1;
	}
	copy = strdup(text);
	if (!copy) {
		mt_snprintf(err, errlen, "out of memory");
		return -1;
	}
	for (item = strtok_r(copy, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
		char *eq = strchr(item, '=');
		const char *value;

		if (!eq) {
			mt_snprintf(err, errlen, "'%.64s' is not key=value (keys: hang-timeout, dir, on-hang, check)", item);
			goto out;
		}
		*eq = '\0';
		value = eq + 1;
		if (!strcmp(item, "hang-timeout")) {
			if (opts->hang_timeout) goto dup;
			if (parse_seconds(value, &secs)) {
				mt_snprintf(err, errlen, "hang-timeout=%.64s: want whole seconds from 1 to %d",
					    value, MT_HANG_TIMEOUT_MAX);
				goto out;
			}
			opts->hang_timeout = secs;
		} else if (!strcmp(item, "dir")) {
			if (opts->dir[0]) goto dup;
			if (valid_path(value) || mt_snprintf(opts->dir, sizeof(opts->dir), "%s", value)) {
				opts->dir[0] = '\0';
				mt_snprintf(err, errlen, "dir=%.64s: want a path without control characters, ',', '=', "
					    "'\\' or '..'", value);
				goto out;
			}
		} else if (!strcmp(item, "on-hang")) {
			if (opts->on_hang) goto dup;
			if ((v = parse_enum(value, on_hang_names, 4)) < 0) {
				mt_snprintf(err, errlen, "on-hang=%.64s: want report, cancel or requeue", value);
				goto out;
			}
			opts->on_hang = v;
		} else if (!strcmp(item, "check")) {
			if (opts->check) goto dup;
			if ((v = parse_enum(value, check_names, 4)) < 0) {
				mt_snprintf(err, errlen, "check=%.64s: want off, quick or full", value);
				goto out;
			}
			opts->check = v;
		} else {
			mt_snprintf(err, errlen, "unknown key '%.64s' (keys: hang-timeout, dir, on-hang, check)", item);
			goto out;
		}
		continue;
dup:
		mt_snprintf(err, errlen, "'%.64s' given twice", item);
		goto out;
	}
	rc = 0;
out:
	free(copy);
	return rc;
}

void mt_opts_fill_defaults(struct mt_job_opts *opts, const struct mt_site_conf *conf)
{
	if (!opts->hang_timeout)
		opts->hang_timeout = conf->hang_timeout;
	if (!opts->on_hang)
		opts->on_hang = conf->on_hang;
	if (!opts->check)
		opts->check = conf->check;
}

/* The normalized option string passed on to the prolog, epilog and tasks. */
int mt_opts_format(const struct mt_job_opts *opts, char *buf, size_t len)
{
	return mt_snprintf(buf, len, "hang-timeout=%ld,on-hang=%s,check=%s%s%s", opts->hang_timeout,
			   mt_on_hang_name(opts->on_hang), mt_check_name(opts->check),
			   opts->dir[0] ? ",dir=" : "", opts->dir);
}
