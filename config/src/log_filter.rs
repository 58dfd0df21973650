//! `logging.level`: a tracing filter, checked while validating so that a misspelt level is
//! refused instead of being read as a target.

/// Level names a tracing filter takes.
const LOG_LEVELS: [&str; 6] = ["trace", "debug", "info", "warn", "error", "off"];

/// Checks a tracing filter: comma-separated directives, each a level name (`info`) or
/// `target=level` (`switchyard=debug`, `actix_web[span]=warn`). tracing's own parser reads a
/// bare word as a target, so a misspelt level (`warning`) would silently turn logging off.
pub fn check_log_filter(filter: &str) -> Result<(), String> {
    let is_level = |l: &str| LOG_LEVELS.iter().any(|n| n.eq_ignore_ascii_case(l));
    let mut directives = 0;
    for d in filter.split(',').map(str::trim).filter(|d| !d.is_empty()) {
        directives += 1;
        let ok = match d.rsplit_once('=') {
            Some((target, level)) => {
                !target.trim().is_empty()
                    && !target.chars().any(char::is_whitespace)
                    && is_level(level.trim())
            }
            None => is_level(d),
        };
        if !ok {
            return Err(format!(
                "`{d}` is neither a level ({}) nor target=level",
                LOG_LEVELS.join(", ")
            ));
        }
    }
    if directives == 0 {
        return Err(format!(
            "a level is required ({}, or target=level directives)",
            LOG_LEVELS.join(", ")
        ));
    }
    Ok(())
}
