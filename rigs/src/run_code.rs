//! Pure pieces of the run-code rig: the requests it sends and the decoding
//! of the code interpreter's `/execute` NDJSON stream. Everything that
//! touches the network, processes or the clock lives in `bin/run-code.rs`.

use anyhow::Context;
use serde_json::Value;

/// The template `Sandbox.create()` of `e2b-code-interpreter` uses by default.
pub const TEMPLATE: &str = "code-interpreter-v1";
/// `POST /v2/sandboxes` body, as the SDK sends it for that template.
pub const CREATE_BODY: &str = r#"{"templateID":"code-interpreter-v1","metadata":{},"envVars":{}}"#;
/// The port the SDK addresses the code interpreter on (`E2b-Sandbox-Port`).
pub const JUPYTER_PORT: &str = "49999";
/// `POST /execute` body of `run_code("1+1")`: all keys present, as the SDK sends them.
pub const EXECUTE_BODY: &str = r#"{"code":"1+1","context_id":null,"language":null,"env_vars":null}"#;
/// The same call in a JavaScript context (`runCode("1+1", {language: "js"})`).
pub const EXECUTE_BODY_JS: &str = r#"{"code":"1+1","context_id":null,"language":"js","env_vars":null}"#;
/// The `text` of the main result `1+1` must produce.
pub const EXPECTED_TEXT: &str = "2";

/// Splits a byte stream into `\n`-terminated lines (a trailing `\r` is
/// dropped); feed body chunks as they arrive, take whole lines out.
#[derive(Debug, Default)]
pub struct LineSplitter {
    buf: Vec<u8>,
}

impl LineSplitter {
    pub fn push(&mut self, chunk: &[u8]) {
        self.buf.extend_from_slice(chunk);
    }

    /// The next complete line without its terminator, `None` if more bytes are needed.
    pub fn next_line(&mut self) -> Option<Vec<u8>> {
        let end = self.buf.iter().position(|b| *b == b'\n')?;
        let mut line: Vec<u8> = self.buf.drain(..=end).collect();
        line.pop();
        if line.last() == Some(&b'\r') {
            line.pop();
        }
        Some(line)
    }

    /// Bytes received but not yet part of a complete line (an unterminated
    /// last line, which the server should never send).
    pub fn pending(&self) -> &[u8] {
        &self.buf
    }
}

/// What one `/execute` output line means to the rig.
#[derive(Debug, Clone, PartialEq)]
pub enum ExecLine {
    /// `type: result`; `main` is `is_main_result` (an `execute_result`, not a `display_data`).
    Result {
        main: bool,
        text: Option<String>,
    },
    /// `type: error` (`name: value`).
    Error(String),
    Stdout,
    Stderr,
    ExecutionCount(Option<u64>),
    Keepalive,
    EndOfExecution,
    /// Any other `type` (kept so oddities can be reported).
    Other(String),
}

/// Interprets one NDJSON line; blank lines are `None`.
pub fn classify_line(line: &[u8]) -> anyhow::Result<Option<ExecLine>> {
    if line.iter().all(u8::is_ascii_whitespace) {
        return Ok(None);
    }
    let v: Value = serde_json::from_slice(line)
        .with_context(|| format!("execute output line is not JSON: {}", String::from_utf8_lossy(line)))?;
    let ty = v.get("type").and_then(Value::as_str).context("execute output line without a `type`")?;
    let text = |k: &str| v.get(k).and_then(Value::as_str).map(str::to_string);
    Ok(Some(match ty {
        "result" => ExecLine::Result {
            main: v.get("is_main_result").and_then(Value::as_bool).unwrap_or(false),
            text: text("text"),
        },
        "error" => {
            ExecLine::Error(format!("{}: {}", text("name").unwrap_or_default(), text("value").unwrap_or_default()))
        }
        "stdout" => ExecLine::Stdout,
        "stderr" => ExecLine::Stderr,
        "number_of_executions" => ExecLine::ExecutionCount(v.get("execution_count").and_then(Value::as_u64)),
        "keepalive" => ExecLine::Keepalive,
        "end_of_execution" => ExecLine::EndOfExecution,
        other => ExecLine::Other(other.to_string()),
    }))
}

/// Checks a finished execution of `1+1`: no error, and a main result `2`.
pub fn check_outcome(main_text: Option<&str>, error: Option<&str>) -> anyhow::Result<()> {
    if let Some(e) = error {
        anyhow::bail!("run_code(\"1+1\") raised {e}");
    }
    match main_text {
        Some(EXPECTED_TEXT) => Ok(()),
        Some(t) => anyhow::bail!("run_code(\"1+1\") returned {t:?}, expected {EXPECTED_TEXT:?}"),
        None => anyhow::bail!("run_code(\"1+1\") ended without a main result"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const STREAM: &str = "{\"type\": \"number_of_executions\", \"execution_count\": 1}\n\
                          {\"type\": \"result\", \"text\": \"2\", \"extra\": {}, \"is_main_result\": true}\n\
                          {\"type\": \"end_of_execution\"}\n";

    #[test]
    fn lines_across_chunks() {
        let mut s = LineSplitter::default();
        let mut items = Vec::new();
        for chunk in STREAM.as_bytes().chunks(7) {
            s.push(chunk);
            while let Some(line) = s.next_line() {
                items.extend(classify_line(&line).unwrap());
            }
        }
        assert!(s.pending().is_empty());
        assert_eq!(
            items,
            vec![
                ExecLine::ExecutionCount(Some(1)),
                ExecLine::Result { main: true, text: Some("2".into()) },
                ExecLine::EndOfExecution,
            ]
        );
    }

    #[test]
    fn crlf_blank_and_partial_lines() {
        let mut s = LineSplitter::default();
        s.push(b"{\"type\": \"keepalive\"}\r\n\n{\"type\": \"std");
        assert_eq!(classify_line(&s.next_line().unwrap()).unwrap(), Some(ExecLine::Keepalive));
        assert_eq!(classify_line(&s.next_line().unwrap()).unwrap(), None);
        assert_eq!(s.next_line(), None);
        assert_eq!(s.pending(), b"{\"type\": \"std");
        s.push(b"out\", \"text\": \"hi\\n\", \"timestamp\": \"t\"}\n");
        assert_eq!(classify_line(&s.next_line().unwrap()).unwrap(), Some(ExecLine::Stdout));
    }

    #[test]
    fn line_kinds() {
        let c = |s: &str| classify_line(s.as_bytes()).unwrap().unwrap();
        assert_eq!(
            c(r#"{"type":"result","png":"AAA","is_main_result":false}"#),
            ExecLine::Result { main: false, text: None }
        );
        assert_eq!(
            c(r#"{"type":"error","name":"NameError","value":"x","traceback":"..."}"#),
            ExecLine::Error("NameError: x".into())
        );
        assert_eq!(c(r#"{"type":"stderr","text":"w","timestamp":"t"}"#), ExecLine::Stderr);
        assert_eq!(c(r#"{"type":"number_of_executions"}"#), ExecLine::ExecutionCount(None));
        assert_eq!(c(r#"{"type":"surprise"}"#), ExecLine::Other("surprise".into()));
        assert!(classify_line(b"not json").is_err());
        assert!(classify_line(br#"{"text":"2"}"#).is_err());
    }

    #[test]
    fn outcomes() {
        assert!(check_outcome(Some("2"), None).is_ok());
        assert!(check_outcome(Some("3"), None).is_err());
        assert!(check_outcome(None, None).is_err());
        assert!(check_outcome(Some("2"), Some("KeyboardInterrupt: ")).is_err());
    }

    #[test]
    fn request_bodies_are_the_sdks() {
        let create: Value = serde_json::from_str(CREATE_BODY).unwrap();
        assert_eq!(create["templateID"], TEMPLATE);
        let exec: Value = serde_json::from_str(EXECUTE_BODY).unwrap();
        assert_eq!(exec["code"], "1+1");
        for k in ["context_id", "language", "env_vars"] {
            assert!(exec[k].is_null() && exec.get(k).is_some(), "{k}");
        }
    }
}
