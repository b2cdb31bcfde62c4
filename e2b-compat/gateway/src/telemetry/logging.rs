//! The gateway's own log: human text (the default) or one JSON object per
//! line (`--log-format json`, tracing-subscriber's JSON formatter) for a log
//! pipeline. Either way every line logged while serving a request carries
//! the request's span (`request_id`, and `sandbox_id` once known, see
//! `api/request_span.rs`), and the background verbs run in a `sandbox` span
//! of their own, so a line about a sandbox always names it.

use tracing_subscriber::EnvFilter;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// Installs the process's subscriber; `COPSE_LOG` filters (default `info`).
pub fn init(format: LogFormat) {
    let filter = EnvFilter::try_from_env("COPSE_LOG").unwrap_or_else(|_| "info".into());
    let builder = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr);
    match format {
        LogFormat::Text => builder.init(),
        // The span list, not only the innermost span: a request's id and
        // its sandbox's are on the outer span whatever is nested inside.
        LogFormat::Json => builder.json().with_current_span(false).with_span_list(true).init(),
    }
}
