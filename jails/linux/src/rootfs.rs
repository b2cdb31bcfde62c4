//! Linux templates: a Debian root filesystem per recipe, built once with
//! debootstrap from the host's package mirror and used read-only as the
//! lower layer of every sandbox's overlay.

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, bail};

use copse_substrate::Progress;
use copse_substrate::template::{Recipe, SANDBOX_HOME, SANDBOX_UID, SANDBOX_USER, TemplateInfo, validate_name};

const DEFAULT_MIRROR: &str = "http://deb.debian.org/debian";
const DEFAULT_SUITE: &str = "bookworm";
/// Written last: a template directory without it is an interrupted build.
const INFO_FILE: &str = "template.json";

pub struct TemplateStore {
    dir: PathBuf,
    cache: PathBuf,
}

impl TemplateStore {
    pub fn new(state_dir: &Path) -> Self {
        Self { dir: state_dir.join("templates"), cache: state_dir.join("cache/debs") }
    }

    pub fn rootfs(&self, name: &str) -> PathBuf {
        self.dir.join(name).join("rootfs")
    }

    pub fn get(&self, name: &str) -> Option<TemplateInfo> {
        validate_name(name).ok()?;
        let text = fs::read_to_string(self.dir.join(name).join(INFO_FILE)).ok()?;
        serde_json::from_str(&text).ok()
    }

    /// Removes template `name` and the older root a rebuild moved aside.
    /// It leaves the listing first, by a rename, so a crash midway leaves
    /// no half template under its name (the next removal of that name
    /// finishes the leftover).
    pub fn remove(&self, name: &str) -> anyhow::Result<()> {
        validate_name(name).map_err(copse_substrate::SubstrateError::Invalid)?;
        let doomed = self.dir.join(format!(".{name}.deleted"));
        remove_tree(&doomed)?;
        fs::rename(self.dir.join(name), &doomed).with_context(|| format!("taking template {name} out"))?;
        remove_tree(&doomed)?;
        remove_tree(&self.dir.join(format!(".{name}.replaced")))
    }

    pub fn list(&self) -> anyhow::Result<Vec<TemplateInfo>> {
        let Ok(entries) = fs::read_dir(&self.dir) else { return Ok(Vec::new()) };
        let mut out: Vec<TemplateInfo> = entries
            .filter_map(Result::ok)
            .filter_map(|e| e.file_name().into_string().ok())
            .filter_map(|name| self.get(&name))
            .collect();
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    pub fn ensure(&self, recipe: &Recipe, progress: Progress<'_>) -> anyhow::Result<TemplateInfo> {
        validate_name(&recipe.name).map_err(copse_substrate::SubstrateError::Invalid)?;
        match self.get(&recipe.name) {
            Some(info) if info.recipe == recipe.fingerprint() => return Ok(info),
            Some(_) => {
                progress(&format!("template {}: its recipe changed since it was built; rebuilding", recipe.name))
            }
            None => {}
        }
        let recipe_fingerprint = recipe.fingerprint();
        self.build(&recipe.name, &recipe_fingerprint, recipe.backend, progress, &mut |rootfs| {
            fs::create_dir_all(&self.cache)?;
            let plan = build_plan(recipe, rootfs, &self.cache, &mirror(), &suite());
            for (i, step) in plan.iter().enumerate() {
                progress(&format!("[{}/{}] {}", i + 1, plan.len(), step.describe()));
                run_streaming(step, progress)
                    .with_context(|| format!("template {}: {}", recipe.name, step.describe()))?;
            }
            Ok(())
        })
    }

    /// A template whose root `fill` writes (an unpacked image) instead of
    /// a recipe's build.
    pub fn import(
        &self,
        name: &str,
        fingerprint: &str,
        fill: &mut dyn FnMut(&Path) -> anyhow::Result<()>,
        progress: Progress<'_>,
    ) -> anyhow::Result<TemplateInfo> {
        validate_name(name).map_err(copse_substrate::SubstrateError::Invalid)?;
        self.build(name, fingerprint, Default::default(), progress, &mut |rootfs| {
            fs::create_dir(rootfs).with_context(|| format!("creating {}", rootfs.display()))?;
            fill(rootfs)
        })
    }

    /// Builds a template aside, moves its files' owners into the sandbox id
    /// range and publishes it, moving an older one of that name aside.
    fn build(
        &self,
        name: &str,
        fingerprint: &str,
        backend: copse_substrate::Backend,
        progress: Progress<'_>,
        fill: &mut dyn FnMut(&Path) -> anyhow::Result<()>,
    ) -> anyhow::Result<TemplateInfo> {
        let final_dir = self.dir.join(name);
        let staging = self.dir.join(format!(".{name}.building"));
        // A rebuilt template's old root may still be the lower layer of
        // running sandboxes: it moves aside (mounts follow the rename)
        // rather than vanishing under them, and goes at the next rebuild.
        let replaced = self.dir.join(format!(".{name}.replaced"));
        remove_tree(&staging)?;
        fs::create_dir_all(&staging)?;
        let rootfs = staging.join("rootfs");
        let built = fill(&rootfs).and_then(|()| {
            // Built as host root; used by sandboxes whose root is host uid BASE.
            progress(&format!("moving the files' owners into the sandbox id range (+{})", crate::ids::BASE));
            crate::ids::shift_tree(&rootfs, 0, crate::ids::BASE)
                .with_context(|| format!("template {name}: shifting owners"))
                .map(drop)
        });
        if let Err(e) = built {
            // The template of that name, if any, is left as it was.
            let _ = remove_tree(&staging);
            return Err(e);
        }
        let info = TemplateInfo {
            name: name.to_string(),
            built_at: SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs()).unwrap_or(0),
            size_bytes: tree_size(&rootfs),
            backend,
            recipe: fingerprint.to_string(),
        };
        fs::write(staging.join(INFO_FILE), serde_json::to_vec_pretty(&info)?)?;
        // Its files reach the disk before its name appears.
        crate::layers::sync_filesystem(&staging)?;
        if final_dir.exists() {
            remove_tree(&replaced)?;
            fs::rename(&final_dir, &replaced).context("moving the outdated template aside")?;
        }
        fs::rename(&staging, &final_dir).context("publishing the template")?;
        fs::File::open(&self.dir).and_then(|d| d.sync_all()).context("syncing the template directory")?;
        progress(&format!("template {} ready ({} MiB)", info.name, info.size_bytes >> 20));
        Ok(info)
    }
}

/// One command of a template build.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Step {
    pub program: String,
    pub args: Vec<String>,
}

impl Step {
    fn new(program: &str, args: &[&str]) -> Self {
        Self { program: program.into(), args: args.iter().map(|a| a.to_string()).collect() }
    }

    fn in_root(rootfs: &Path, script: &str) -> Self {
        Self::new("chroot", &[&rootfs.display().to_string(), "/bin/sh", "-ec", script])
    }

    fn describe(&self) -> String {
        let mut line = self.program.clone();
        for arg in &self.args {
            line.push(' ');
            line.push_str(arg);
        }
        if line.len() > 120 {
            line.truncate(117);
            line.push_str("...");
        }
        line
    }
}

/// The commands that build `recipe` into `rootfs`.
pub fn build_plan(recipe: &Recipe, rootfs: &Path, cache: &Path, mirror: &str, suite: &str) -> Vec<Step> {
    let root = rootfs.display().to_string();
    // apt, not debootstrap's own resolver, installs the recipe's packages:
    // it understands virtual packages and alternatives.
    let mut steps = vec![Step::new(
        "debootstrap",
        &["--variant=minbase", &format!("--cache-dir={}", cache.display()), suite, &root, mirror],
    )];
    if !recipe.packages.is_empty() {
        steps.push(Step::in_root(
            rootfs,
            &format!(
                "apt-get update -qq && apt-get install -y -q --no-install-recommends {} && apt-get clean",
                recipe.packages.join(" ")
            ),
        ));
    }
    let user_setup = format!(
        "groupadd -g {uid} {user} && useradd -m -u {uid} -g {uid} -d {home} -s /bin/bash {user} \
         && printf 'localhost\\n' > /etc/hostname \
         && printf '127.0.0.1 localhost\\n::1 localhost\\n' > /etc/hosts",
        uid = SANDBOX_UID,
        user = SANDBOX_USER,
        home = SANDBOX_HOME,
    );
    steps.push(Step::in_root(rootfs, &user_setup));
    for script in &recipe.post_install {
        steps.push(Step::in_root(rootfs, script));
    }
    // Package caches would be copied into every template for nothing.
    steps.push(Step::in_root(rootfs, "rm -rf /var/cache/apt/archives/*.deb /var/lib/apt/lists/* /tmp/*"));
    steps
}

fn run_streaming(step: &Step, progress: Progress<'_>) -> anyhow::Result<()> {
    let mut child = Command::new(&step.program)
        .args(&step.args)
        .env("DEBIAN_FRONTEND", "noninteractive")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {} (is it installed?)", step.program))?;
    let stderr = child.stderr.take().expect("piped");
    let stderr_lines =
        std::thread::spawn(move || BufReader::new(stderr).lines().map_while(Result::ok).collect::<Vec<_>>());
    for line in BufReader::new(child.stdout.take().expect("piped")).lines().map_while(Result::ok) {
        progress(&line);
    }
    let status = child.wait()?;
    let stderr = stderr_lines.join().unwrap_or_default();
    if !status.success() {
        let tail: Vec<_> = stderr.iter().rev().take(15).rev().cloned().collect();
        bail!("{} failed ({status}):\n{}", step.program, tail.join("\n"));
    }
    Ok(())
}

fn mirror() -> String {
    std::env::var("COPSE_DEBIAN_MIRROR").unwrap_or_else(|_| DEFAULT_MIRROR.into())
}

fn suite() -> String {
    std::env::var("COPSE_DEBIAN_SUITE").unwrap_or_else(|_| DEFAULT_SUITE.into())
}

fn remove_tree(path: &Path) -> anyhow::Result<()> {
    match fs::remove_dir_all(path) {
        Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
            Err(e).with_context(|| format!("removing {}", path.display()))
        }
        _ => Ok(()),
    }
}

/// Bytes of regular files under `path`, without following links.
pub fn tree_size(path: &Path) -> u64 {
    let mut total = 0;
    let mut stack = vec![path.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = fs::read_dir(&dir) else { continue };
        for entry in entries.filter_map(Result::ok) {
            let Ok(meta) = entry.metadata() else { continue };
            if meta.is_dir() {
                stack.push(entry.path());
            } else if meta.is_file() {
                total += meta.len();
            }
        }
    }
    total
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_removed_template_leaves_the_listing_with_its_replaced_root() {
        let dir = tempfile::tempdir().unwrap();
        let store = TemplateStore::new(dir.path());
        for name in ["image-a", "image-b", ".image-a.replaced"] {
            let root = store.dir.join(name);
            fs::create_dir_all(root.join("rootfs/etc")).unwrap();
            let info = TemplateInfo {
                name: name.into(),
                built_at: 0,
                size_bytes: 0,
                backend: Default::default(),
                recipe: "sha256:x".into(),
            };
            fs::write(root.join(INFO_FILE), serde_json::to_vec(&info).unwrap()).unwrap();
        }
        store.remove("image-a").unwrap();
        assert_eq!(store.list().unwrap().iter().map(|t| t.name.as_str()).collect::<Vec<_>>(), ["image-b"]);
        let left: Vec<_> = fs::read_dir(&store.dir).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left, ["image-b"]);
        assert!(store.remove("image-a").is_err(), "already gone");
        assert!(store.remove("../etc").is_err());
    }

    #[test]
    fn plan_bootstraps_installs_adds_the_sandbox_user_then_cleans() {
        let recipe = Recipe {
            name: "base".into(),
            packages: vec!["python3".into(), "curl".into()],
            post_install: vec!["echo hi".into()],
            backend: Default::default(),
        };
        let plan = build_plan(&recipe, Path::new("/t/rootfs"), Path::new("/c"), "http://m/debian", "bookworm");
        assert_eq!(plan[0].program, "debootstrap");
        assert_eq!(plan[0].args, ["--variant=minbase", "--cache-dir=/c", "bookworm", "/t/rootfs", "http://m/debian"]);
        assert_eq!(plan[1].program, "chroot");
        assert_eq!(&plan[1].args[..3], ["/t/rootfs", "/bin/sh", "-ec"]);
        assert!(plan[1].args[3].contains("apt-get install -y -q --no-install-recommends python3 curl"));
        assert!(plan[2].args[3].contains("useradd -m -u 1000 -g 1000 -d /home/user -s /bin/bash user"));
        assert_eq!(plan[3].args[3], "echo hi");
        assert!(plan[4].args[3].starts_with("rm -rf /var/cache/apt/archives"));
    }
}
