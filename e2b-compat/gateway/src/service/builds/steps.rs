//! A build's steps as the SDK sends them (`TemplateStep`: a type and its
//! string arguments), checked and turned into plain data, and the shell
//! each one runs inside the build sandbox. Pure: tested without a sandbox.
//!
//! The SDK sends five types; every other builder call (`pip_install`,
//! `apt_install`, `make_dir`, `remove`, `rename`, `make_symlink`,
//! `git_clone`…) arrives as a `RUN` with its own command line.

use crate::model::{Result, SandboxError, validate_files_hash};

/// Where a copy's archive waits inside the build sandbox before unpacking.
pub const COPY_ARCHIVE_DIR: &str = "/tmp";

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Step {
    /// A shell command, as `user` if given (else the build's current user).
    Run {
        command: String,
        user: Option<String>,
    },
    Env(Vec<(String, String)>),
    Workdir(String),
    User(String),
    /// The uploaded archive `hash`, whose `src` (relative to the upload's
    /// context) lands at `dest`, owned by `owner` and with `mode` if given.
    Copy {
        src: String,
        dest: String,
        owner: Option<String>,
        mode: Option<String>,
        hash: String,
    },
}

/// The raw step as it came over the wire.
#[derive(Debug, Clone, Default)]
pub struct RawStep {
    pub kind: String,
    pub args: Vec<String>,
    pub files_hash: Option<String>,
    /// `skip_cache` was called before it.
    pub force: bool,
}

/// Checks every step before anything runs: a bad one is refused with its
/// number (1-based, as the SDK counts them), not found half-way.
pub fn parse(raw: &[RawStep]) -> Result<Vec<Step>> {
    raw.iter().enumerate().map(|(i, step)| parse_one(step).map_err(|e| invalid(i + 1, e))).collect()
}

fn invalid(number: usize, why: String) -> SandboxError {
    SandboxError::Invalid(format!("step {number}: {why}"))
}

fn parse_one(step: &RawStep) -> std::result::Result<Step, String> {
    let args = &step.args;
    let arg = |i: usize| args.get(i).map(String::as_str).filter(|a| !a.is_empty());
    match step.kind.as_str() {
        "RUN" => {
            let command = arg(0).ok_or("RUN needs a command")?.to_string();
            let user = arg(1).map(user_name).transpose()?;
            Ok(Step::Run { command, user })
        }
        "ENV" => {
            if !args.len().is_multiple_of(2) || args.is_empty() {
                return Err("ENV needs name and value pairs".into());
            }
            let pairs: Vec<(String, String)> = args.chunks(2).map(|p| (p[0].clone(), p[1].clone())).collect();
            if let Some((bad, _)) = pairs.iter().find(|(k, _)| !env_name_ok(k)) {
                return Err(format!("invalid environment variable name {bad:?}"));
            }
            Ok(Step::Env(pairs))
        }
        "WORKDIR" => Ok(Step::Workdir(absolute(arg(0).ok_or("WORKDIR needs a path")?)?)),
        "USER" => Ok(Step::User(user_name(arg(0).ok_or("USER needs a user name")?)?)),
        "COPY" => {
            let src = arg(0).ok_or("COPY needs a source")?.to_string();
            if src.starts_with('/') || src.split('/').any(|part| part == "..") {
                return Err(format!("COPY source {src:?} must be relative to the build context"));
            }
            let dest = arg(1).ok_or("COPY needs a destination")?.to_string();
            let owner = arg(2).map(owner_name).transpose()?;
            let mode = arg(3).map(mode).transpose()?;
            let hash = step.files_hash.clone().ok_or("COPY needs its filesHash")?;
            validate_files_hash(&hash).map_err(|e| e.to_string())?;
            Ok(Step::Copy { src, dest, owner, mode, hash })
        }
        other => Err(format!("unknown step type {other:?} (expected RUN, ENV, WORKDIR, USER or COPY)")),
    }
}

fn env_name_ok(name: &str) -> bool {
    !name.is_empty()
        && !name.starts_with(|c: char| c.is_ascii_digit())
        && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
}

fn user_name(name: &str) -> std::result::Result<String, String> {
    let ok = name.len() <= 32
        && !name.starts_with('-')
        && name.chars().all(|c| c.is_ascii_alphanumeric() || "_-.".contains(c));
    if ok { Ok(name.to_string()) } else { Err(format!("invalid user name {name:?}")) }
}

/// `user` or `user:group`.
fn owner_name(owner: &str) -> std::result::Result<String, String> {
    match owner.split_once(':') {
        Some((user, group)) => Ok(format!("{}:{}", user_name(user)?, user_name(group)?)),
        None => user_name(owner),
    }
}

fn mode(mode: &str) -> std::result::Result<String, String> {
    let ok = !mode.is_empty() && mode.len() <= 5 && mode.bytes().all(|b| (b'0'..=b'7').contains(&b));
    if ok { Ok(mode.to_string()) } else { Err(format!("invalid mode {mode:?}: expected octal digits")) }
}

fn absolute(path: &str) -> std::result::Result<String, String> {
    if path.starts_with('/') { Ok(path.to_string()) } else { Err(format!("{path:?} is not an absolute path")) }
}

/// One word for `sh`, whatever it contains.
pub fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

/// A copy source for `sh`: literal, except `*`, `?` and `[`, which the
/// SDK lets a source use as a glob.
fn quote_glob(s: &str) -> String {
    let mut out = String::new();
    for c in s.chars() {
        if "*?[]".contains(c) || c.is_ascii_alphanumeric() || "/._-".contains(c) {
            out.push(c);
        } else {
            out.push('\\');
            out.push(c);
        }
    }
    out
}

/// The archive's path inside the build sandbox.
pub fn copy_archive(hash: &str) -> String {
    format!("{COPY_ARCHIVE_DIR}/.copse-copy-{hash}.tar")
}

/// Makes `dir` (for WORKDIR): each missing component, parents included, is
/// made and given to `user`, so the user's later steps can write there;
/// existing ones keep their owner. As root, so a directory the user may not
/// write (`/opt`) or enter (`/root`) can still hold the user's workdir.
pub fn workdir_script(dir: &str, user: &str) -> String {
    let mut prefixes = Vec::new();
    let mut path = String::new();
    for part in dir.split('/').filter(|p| !p.is_empty() && *p != ".") {
        path.push('/');
        path.push_str(part);
        prefixes.push(quote(&path));
    }
    let user = quote(user);
    format!(
        "for d in {}; do [ -d \"$d\" ] || {{ mkdir -- \"$d\" && chown -- {user}: \"$d\"; }} || exit 1; done",
        prefixes.join(" ")
    )
}

/// Creates `user` (for USER) if the root has no such account.
pub fn user_script(user: &str) -> String {
    let user = quote(user);
    format!("id -u -- {user} >/dev/null 2>&1 || useradd --create-home --shell /bin/bash -- {user}")
}

/// Unpacks the archive into a fresh directory inside the sandbox and
/// copies `src` from it to `dest`, as Docker's COPY places things: a
/// directory's contents into `dest`; a file to `dest`, or into it when
/// `dest` ends in `/` or several files match. Runs as the owner inside
/// the sandbox; tar itself refuses members with `..` and strips leading `/`,
/// and nothing of the archive is ever unpacked on the host.
pub fn copy_script(src: &str, dest: &str, owner: &str, mode: Option<&str>, hash: &str) -> String {
    let archive = quote(&copy_archive(hash));
    let src_glob = quote_glob(src.trim_end_matches('/'));
    let src_glob = if src_glob.is_empty() { ".".to_string() } else { src_glob };
    let dest_q = quote(dest);
    let owner = quote(owner);
    let chmod = match mode {
        Some(mode) => format!("find \"$@\" -type f -exec chmod {mode} {{}} +\n"),
        None => String::new(),
    };
    format!(
        r#"set -eu
staging=$(mktemp -d /tmp/.copse-copy.XXXXXX)
trap 'rm -rf "$staging"' EXIT
tar -x --no-same-owner -f {archive} -C "$staging"
rm -f {archive}
cd "$staging"
set -- {src_glob}
[ -e "$1" ] || [ -L "$1" ] || {{ echo "copy: nothing matches {src}" >&2; exit 1; }}
dest={dest_q}
if [ "$#" -eq 1 ] && [ -d "$1" ] && [ ! -L "$1" ]; then
  mkdir -p -- "$dest"
  cp -a -- "$1"/. "$dest"/
  set -- "$dest"
elif [ "$#" -gt 1 ] || [ "${{dest%/}}" != "$dest" ]; then
  mkdir -p -- "$dest"
  cp -a -- "$@" "$dest"/
  n=""; for f in "$@"; do n="$n ${{dest%/}}/${{f##*/}}"; done
  set -- $n
else
  mkdir -p -- "$(dirname -- "$dest")"
  cp -a -- "$1" "$dest"
  set -- "$dest"
fi
chown -hR -- {owner} "$@"
{chmod}"#
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(kind: &str, args: &[&str]) -> RawStep {
        RawStep {
            kind: kind.into(),
            args: args.iter().map(|a| a.to_string()).collect(),
            files_hash: None,
            force: false,
        }
    }

    #[test]
    fn the_sdk_step_types_parse() {
        let hash = "a".repeat(64);
        let mut copy = raw("COPY", &["app/", "/home/user/app/", "", "0755"]);
        copy.files_hash = Some(hash.clone());
        let steps = parse(&[
            raw("RUN", &["echo hi"]),
            raw("RUN", &["apt-get install -y git", "root"]),
            raw("ENV", &["A", "1", "B", "two words"]),
            raw("WORKDIR", &["/home/user/app"]),
            raw("USER", &["root"]),
            copy,
        ])
        .unwrap();
        assert_eq!(steps[0], Step::Run { command: "echo hi".into(), user: None });
        assert_eq!(steps[1], Step::Run { command: "apt-get install -y git".into(), user: Some("root".into()) });
        assert_eq!(steps[2], Step::Env(vec![("A".into(), "1".into()), ("B".into(), "two words".into())]));
        assert_eq!(steps[3], Step::Workdir("/home/user/app".into()));
        assert_eq!(steps[4], Step::User("root".into()));
        assert_eq!(
            steps[5],
            Step::Copy {
                src: "app/".into(),
                dest: "/home/user/app/".into(),
                owner: None,
                mode: Some("0755".into()),
                hash
            }
        );
    }

    #[test]
    fn bad_steps_are_refused_by_number() {
        let err = parse(&[raw("RUN", &["true"]), raw("ENV", &["1BAD", "x"])]).unwrap_err().to_string();
        assert!(err.starts_with("step 2:"), "{err}");
        assert!(parse(&[raw("FROM", &["x"])]).is_err());
        assert!(parse(&[raw("WORKDIR", &["relative"])]).is_err());
        assert!(parse(&[raw("USER", &["-oops"])]).is_err());
        assert!(parse(&[raw("RUN", &["true", "a b"])]).is_err());
        let mut escape = raw("COPY", &["../secret", "/x"]);
        escape.files_hash = Some("a".repeat(64));
        assert!(parse(&[escape]).is_err());
        let mut bad_hash = raw("COPY", &["a", "/x"]);
        bad_hash.files_hash = Some("../../etc".into());
        assert!(parse(&[bad_hash]).is_err());
        let mut bad_mode = raw("COPY", &["a", "/x", "", "0999"]);
        bad_mode.files_hash = Some("a".repeat(64));
        assert!(parse(&[bad_mode]).is_err());
    }

    #[test]
    fn scripts_quote_what_they_are_given() {
        assert_eq!(quote("it's"), r"'it'\''s'");
        assert_eq!(quote_glob("src/*.py"), "src/*.py");
        assert_eq!(quote_glob("a b;c"), r"a\ b\;c");
        let script = copy_script("app/", "/home/user/o'k/", "user", Some("0644"), &"b".repeat(64));
        assert!(script.contains(r"dest='/home/user/o'\''k/'"));
        assert!(script.contains("set -- app\n"));
        assert!(script.contains("chmod 0644"));
        assert_eq!(
            workdir_script("/opt//app/", "us'er"),
            r#"for d in '/opt' '/opt/app'; do [ -d "$d" ] || { mkdir -- "$d" && chown -- 'us'\''er': "$d"; } || exit 1; done"#
        );
    }
}
