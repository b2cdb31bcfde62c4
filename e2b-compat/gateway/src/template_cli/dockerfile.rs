//! A Dockerfile turned into the build the SDK's `from_dockerfile` would
//! send: `FROM` becomes the base image (which the gateway maps as it maps
//! the SDK's), `RUN`, `COPY`, `ENV`, `ARG`, `WORKDIR` and `USER` become
//! steps, `CMD`/`ENTRYPOINT` the start command. As the SDK does, the steps
//! run as root in `/` and the template ends as `user` in `/home/user`
//! unless the Dockerfile chose otherwise. Anything else is refused naming
//! its line, never skipped silently (only `EXPOSE`, `VOLUME`, `LABEL` and
//! `MAINTAINER`, which change nothing in a sandbox, are ignored, as the
//! SDK ignores them).

use std::collections::HashMap;

use anyhow::{Context, bail};

use super::definition::{Definition, Step};

const IGNORED: &[&str] = &["EXPOSE", "VOLUME", "LABEL", "MAINTAINER"];

/// One instruction: its keyword, the rest of its (joined) line, and the
/// line it started on.
struct Instruction {
    keyword: String,
    rest: String,
    line: usize,
}

fn instructions(text: &str) -> Vec<Instruction> {
    let mut out = Vec::new();
    let mut pending: Option<(usize, String)> = None;
    for (i, raw) in text.lines().enumerate() {
        let trimmed = raw.trim();
        if pending.is_none() && (trimmed.is_empty() || trimmed.starts_with('#')) {
            continue;
        }
        // Comment lines inside a continued instruction are dropped, as
        // Docker drops them.
        if pending.is_some() && trimmed.starts_with('#') {
            continue;
        }
        let (start, mut joined) = pending.take().unwrap_or((i + 1, String::new()));
        match trimmed.strip_suffix('\\') {
            Some(part) => {
                joined.push_str(part);
                joined.push(' ');
                pending = Some((start, joined));
            }
            None => {
                joined.push_str(trimmed);
                push(&mut out, start, &joined);
            }
        }
    }
    if let Some((start, joined)) = pending {
        push(&mut out, start, &joined);
    }
    out
}

fn push(out: &mut Vec<Instruction>, line: usize, joined: &str) {
    let joined = joined.trim();
    let (keyword, rest) = joined.split_once(char::is_whitespace).unwrap_or((joined, ""));
    out.push(Instruction { keyword: keyword.to_ascii_uppercase(), rest: rest.trim().to_string(), line });
}

/// `["a", "b"]` (exec form), else `None` (shell form).
fn exec_form(rest: &str) -> Option<Vec<String>> {
    rest.starts_with('[').then(|| serde_json::from_str(rest).ok()).flatten()
}

/// Words split on blanks, honouring double and single quotes and `\`.
fn words(rest: &str) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    let mut word = String::new();
    let mut in_word = false;
    let mut chars = rest.chars();
    let mut quote: Option<char> = None;
    while let Some(c) = chars.next() {
        match (quote, c) {
            (Some(q), c) if c == q => quote = None,
            (Some('"'), '\\') | (None, '\\') => {
                word.extend(chars.next());
                in_word = true;
            }
            (Some(_), c) => word.push(c),
            (None, '"' | '\'') => {
                quote = Some(c);
                in_word = true;
            }
            (None, c) if c.is_whitespace() => {
                if in_word {
                    out.push(std::mem::take(&mut word));
                    in_word = false;
                }
            }
            (None, c) => {
                word.push(c);
                in_word = true;
            }
        }
    }
    if quote.is_some() {
        bail!("unterminated quote");
    }
    if in_word {
        out.push(word);
    }
    Ok(out)
}

/// `$NAME` and `${NAME}` from the ARG and ENV values seen so far; unknown
/// names become empty, as Docker makes them.
fn expand(word: &str, vars: &HashMap<String, String>) -> String {
    let mut out = String::new();
    let mut rest = word;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let (name, skip) = if let Some(braced) = after.strip_prefix('{') {
            match braced.find('}') {
                Some(end) => (&braced[..end], end + 2),
                None => ("", 0),
            }
        } else {
            let end = after.find(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).unwrap_or(after.len());
            (&after[..end], end)
        };
        if name.is_empty() {
            out.push('$');
            rest = after;
        } else {
            out.push_str(vars.get(name).map(String::as_str).unwrap_or(""));
            rest = &after[skip..];
        }
    }
    out.push_str(rest);
    out
}

fn shell_join(words: &[String]) -> String {
    words.iter().map(|w| super::definition::quote(w)).collect::<Vec<_>>().join(" ")
}

/// `--name=value` flags at the front of an instruction's words.
fn flags(words: &mut Vec<String>) -> HashMap<String, String> {
    let mut found = HashMap::new();
    while let Some(first) = words.first().filter(|w| w.starts_with("--")) {
        let (name, value) = first[2..].split_once('=').unwrap_or((&first[2..], ""));
        found.insert(name.to_string(), value.to_string());
        words.remove(0);
    }
    found
}

/// Key/value pairs of `ENV a=1 b=2`, or the older `ENV a 1`.
fn pairs(rest: &str) -> anyhow::Result<Vec<(String, String)>> {
    let list = words(rest)?;
    if list.iter().all(|w| w.contains('=')) {
        return Ok(list
            .iter()
            .map(|w| {
                let (k, v) = w.split_once('=').expect("checked");
                (k.to_string(), v.to_string())
            })
            .collect());
    }
    let (key, value) = rest.split_once(char::is_whitespace).context("expected NAME=value")?;
    let value = words(value.trim())?.join(" ");
    Ok(vec![(key.to_string(), value)])
}

pub fn parse(text: &str) -> anyhow::Result<Definition> {
    let mut def = Definition::default();
    let mut vars: HashMap<String, String> = HashMap::new();
    let mut seen_from = false;
    let mut user_changed = false;
    let mut workdir_changed = false;
    let mut workdir = "/".to_string();
    let mut cmd: Option<(bool, Vec<String>)> = None;
    let mut entrypoint: Option<(bool, Vec<String>)> = None;
    for ins in instructions(text) {
        let line = ins.line;
        let at = || format!("line {line}: {}", ins.keyword);
        let result: anyhow::Result<()> = (|| {
            if !seen_from && !matches!(ins.keyword.as_str(), "FROM" | "ARG") {
                bail!("must come after FROM");
            }
            match ins.keyword.as_str() {
                "FROM" => {
                    if seen_from {
                        bail!("multi-stage Dockerfiles are not supported");
                    }
                    let mut list = words(&ins.rest)?;
                    flags(&mut list);
                    let image = match list.as_slice() {
                        [image] => image,
                        [image, r#as, _] if r#as.eq_ignore_ascii_case("as") => image,
                        _ => bail!("expected FROM IMAGE [AS NAME]"),
                    };
                    def.from_image = Some(expand(image, &vars));
                    seen_from = true;
                    def.steps.push(Step::of("USER", vec!["root".into()]));
                    def.steps.push(Step::of("WORKDIR", vec!["/".into()]));
                }
                "ARG" => {
                    for word in words(&ins.rest)? {
                        let (name, value) = word.split_once('=').unwrap_or((word.as_str(), ""));
                        let value = expand(value, &vars);
                        vars.insert(name.to_string(), value.clone());
                        if seen_from {
                            def.steps.push(Step::of("ENV", vec![name.to_string(), value]));
                        }
                    }
                }
                "ENV" => {
                    let mut args = Vec::new();
                    for (key, value) in pairs(&ins.rest)? {
                        let value = expand(&value, &vars);
                        vars.insert(key.clone(), value.clone());
                        args.extend([key, value]);
                    }
                    def.steps.push(Step::of("ENV", args));
                }
                "RUN" => {
                    if ins.rest.contains("<<") {
                        bail!("heredocs are not supported by the CLI; use the SDK's from_dockerfile");
                    }
                    let command = match exec_form(&ins.rest) {
                        Some(list) => shell_join(&list),
                        None if ins.rest.starts_with("--") => {
                            bail!("RUN flags (--mount, --network) are not supported")
                        }
                        None => ins.rest.clone(),
                    };
                    if command.trim().is_empty() {
                        bail!("needs a command");
                    }
                    def.steps.push(Step::of("RUN", vec![command]));
                }
                "COPY" | "ADD" => {
                    let mut list = exec_form(&ins.rest).map(Ok).unwrap_or_else(|| words(&ins.rest))?;
                    let found = flags(&mut list);
                    if found.contains_key("from") {
                        bail!("--from is not supported (multi-stage builds are not supported)");
                    }
                    if let Some(unknown) = found.keys().find(|k| !matches!(k.as_str(), "chown" | "chmod")) {
                        bail!("flag --{unknown} is not supported");
                    }
                    if list.len() < 2 {
                        bail!("needs a source and a destination");
                    }
                    let dest = expand(&list.pop().expect("two"), &vars);
                    let dest = match dest.strip_prefix("./").unwrap_or(&dest) {
                        absolute if absolute.starts_with('/') => absolute.to_string(),
                        relative => format!("{}/{relative}", workdir.trim_end_matches('/')),
                    };
                    let owner = found.get("chown").map(|o| expand(o, &vars)).unwrap_or_default();
                    let mode = found.get("chmod").map(|m| expand(m, &vars)).unwrap_or_default();
                    let several = list.len() > 1;
                    for src in list {
                        let src = expand(&src, &vars);
                        if src.contains("://") {
                            bail!("remote sources are not supported: {src}");
                        }
                        let dest = if several && !dest.ends_with('/') { format!("{dest}/") } else { dest.clone() };
                        def.steps.push(Step::of("COPY", vec![src, dest, owner.clone(), mode.clone()]));
                    }
                }
                "WORKDIR" => {
                    let dir = expand(&words(&ins.rest)?.join(" "), &vars);
                    if dir.is_empty() {
                        bail!("needs a path");
                    }
                    workdir =
                        if dir.starts_with('/') { dir } else { format!("{}/{dir}", workdir.trim_end_matches('/')) };
                    def.steps.push(Step::of("WORKDIR", vec![workdir.clone()]));
                    workdir_changed = true;
                }
                "USER" => {
                    let user = expand(&words(&ins.rest)?.join(" "), &vars);
                    if user.is_empty() {
                        bail!("needs a user name");
                    }
                    def.steps.push(Step::of("USER", vec![user]));
                    user_changed = true;
                }
                "CMD" => cmd = Some(start_form(&ins.rest)?),
                "ENTRYPOINT" => entrypoint = Some(start_form(&ins.rest)?),
                k if IGNORED.contains(&k) => {}
                _ => bail!(
                    "is not supported (supported: FROM, RUN, COPY, ADD, ENV, ARG, WORKDIR, USER, CMD, ENTRYPOINT)"
                ),
            }
            Ok(())
        })();
        result.with_context(at)?;
    }
    if !seen_from {
        bail!("the Dockerfile has no FROM instruction");
    }
    def.start_cmd = start_command(entrypoint, cmd);
    if !user_changed {
        def.steps.push(Step::of("USER", vec!["user".into()]));
    }
    if !workdir_changed {
        def.steps.push(Step::of("WORKDIR", vec!["/home/user".into()]));
    }
    Ok(def)
}

fn start_form(rest: &str) -> anyhow::Result<(bool, Vec<String>)> {
    Ok(match exec_form(rest) {
        Some(list) => (true, list),
        None => (false, vec![rest.to_string()]),
    })
}

/// Docker's rules: an exec-form ENTRYPOINT takes CMD as arguments, a
/// shell-form one ignores CMD, else CMD alone.
fn start_command(entrypoint: Option<(bool, Vec<String>)>, cmd: Option<(bool, Vec<String>)>) -> Option<String> {
    let command = match (entrypoint, cmd) {
        (Some((true, mut words)), cmd) => {
            match cmd {
                Some((true, args)) => words.extend(args),
                Some((false, args)) => words.extend(["/bin/sh".to_string(), "-c".into(), args.join(" ")]),
                None => {}
            }
            shell_join(&words)
        }
        (Some((false, words)), _) => words.join(" "),
        (None, Some((true, words))) => shell_join(&words),
        (None, Some((false, words))) => words.join(" "),
        (None, None) => return None,
    };
    (!command.trim().is_empty()).then_some(command)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kinds(def: &Definition) -> Vec<String> {
        def.steps.iter().map(|s| format!("{} {}", s.kind, s.args.join("|"))).collect()
    }

    #[test]
    fn every_supported_instruction_becomes_the_sdks_step() {
        let def = parse(
            r#"# a comment
ARG VERSION=1.2
FROM debian:bookworm AS base
ENV MODE="two words" OTHER=$VERSION
RUN apt-get update && \
    apt-get install -y git
RUN ["echo", "it's"]
WORKDIR app
COPY --chown=user:user --chmod=755 src/ ./dest/
ADD a.txt b.txt /opt/
USER nobody
EXPOSE 8080
CMD ["python3", "-m", "http.server"]
"#,
        )
        .unwrap();
        assert_eq!(def.from_image.as_deref(), Some("debian:bookworm"));
        assert_eq!(
            kinds(&def),
            vec![
                "USER root",
                "WORKDIR /",
                "ENV MODE|two words|OTHER|1.2",
                "RUN apt-get update &&  apt-get install -y git",
                "RUN 'echo' 'it'\\''s'",
                "WORKDIR /app",
                "COPY src/|/app/dest/|user:user|755",
                "COPY a.txt|/opt/||",
                "COPY b.txt|/opt/||",
                "USER nobody",
            ]
        );
        assert_eq!(def.start_cmd.as_deref(), Some("'python3' '-m' 'http.server'"));
    }

    #[test]
    fn defaults_end_as_the_sdk_leaves_them() {
        let def = parse("FROM e2bdev/base\nRUN true\n").unwrap();
        assert_eq!(kinds(&def), vec!["USER root", "WORKDIR /", "RUN true", "USER user", "WORKDIR /home/user"]);
        assert_eq!(def.start_cmd, None);
    }

    #[test]
    fn entrypoint_takes_cmd_as_arguments() {
        let def = parse("FROM x\nENTRYPOINT [\"tini\", \"--\"]\nCMD [\"srv\"]\n").unwrap();
        assert_eq!(def.start_cmd.as_deref(), Some("'tini' '--' 'srv'"));
        let def = parse("FROM x\nENTRYPOINT run.sh\nCMD [\"ignored\"]\n").unwrap();
        assert_eq!(def.start_cmd.as_deref(), Some("run.sh"));
    }

    #[test]
    fn unsupported_instructions_name_their_line() {
        for (text, line, why) in [
            ("FROM a\nRUN x\nHEALTHCHECK CMD true\n", "line 3: HEALTHCHECK", "not supported"),
            ("FROM a\nFROM b\n", "line 2: FROM", "multi-stage"),
            ("RUN x\n", "line 1: RUN", "after FROM"),
            ("FROM a\nCOPY --from=b /x /y\n", "line 2: COPY", "--from"),
            ("FROM a\nRUN <<EOF\nx\nEOF\n", "line 2: RUN", "heredocs"),
            ("FROM a\nADD https://x/y /z\n", "line 2: ADD", "remote"),
            ("FROM a\nENV A \"open\n", "line 2: ENV", "unterminated"),
        ] {
            let err = format!("{:#}", parse(text).unwrap_err());
            assert!(err.contains(line) && err.contains(why), "{text:?}: {err}");
        }
        assert!(format!("{:#}", parse("# nothing\n").unwrap_err()).contains("no FROM"));
    }

    #[test]
    fn variables_expand_outside_run() {
        let vars = HashMap::from([("A".to_string(), "x".to_string())]);
        assert_eq!(expand("$A/${A}-$B-$", &vars), "x/x--$");
    }
}
