//! One exported bhyve snapshot as a stream: a JSON header line, the
//! checkpoint's three files back to back, then the disk's `zfs send` stream
//! to the end (written and read by the caller).

use std::io::{Read, Write};
use std::path::Path;

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};

const FORMAT: &str = "copse-bhyve-snapshot";
/// Checkpoint files as `bhyvectl --suspend=DIR/vm.ckp` names them.
pub const FILES: [&str; 3] = ["vm.ckp", "vm.ckp.kern", "vm.ckp.meta"];

#[derive(Debug, Serialize, Deserialize)]
struct Header {
    format: String,
    version: u32,
    template: String,
    files: Vec<(String, u64)>,
}

/// Header and checkpoint files of the snapshot kept in `dir`.
pub fn write_head(out: &mut dyn Write, template: &str, dir: &Path) -> anyhow::Result<()> {
    let mut files = Vec::new();
    for name in FILES {
        let len = std::fs::metadata(dir.join(name)).with_context(|| format!("{}/{name}", dir.display()))?.len();
        files.push((name.to_string(), len));
    }
    let header = Header { format: FORMAT.into(), version: 1, template: template.into(), files };
    out.write_all(serde_json::to_string(&header)?.as_bytes())?;
    out.write_all(b"\n")?;
    for name in FILES {
        std::io::copy(&mut std::fs::File::open(dir.join(name))?, out)?;
    }
    Ok(())
}

/// Reads what [`write_head`] wrote, putting the files into `dir`; returns
/// the template. The input is left at the disk stream.
pub fn read_head(input: &mut dyn Read, dir: &Path) -> anyhow::Result<String> {
    let mut line = Vec::new();
    let mut byte = [0u8];
    while input.read(&mut byte)? == 1 && byte[0] != b'\n' {
        if line.len() > 64 << 10 {
            bail!("not a bhyve snapshot stream: header too long");
        }
        line.push(byte[0]);
    }
    let header: Header = serde_json::from_slice(&line).context("not a bhyve snapshot stream")?;
    if header.format != FORMAT || header.version != 1 {
        bail!("not a bhyve snapshot stream (format {} v{})", header.format, header.version);
    }
    let names: Vec<&str> = header.files.iter().map(|(n, _)| n.as_str()).collect();
    if names != FILES {
        bail!("bhyve snapshot stream lists unexpected files {names:?}");
    }
    for (name, len) in &header.files {
        let mut file = std::fs::File::create(dir.join(name))?;
        let copied = std::io::copy(&mut input.take(*len), &mut file)?;
        if copied != *len {
            bail!("bhyve snapshot stream ends inside {name}");
        }
    }
    Ok(header.template)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_leaves_the_disk_stream() {
        let from = tempfile::tempdir().unwrap();
        for (i, name) in FILES.iter().enumerate() {
            std::fs::write(from.path().join(name), vec![i as u8; 1000 * (i + 1)]).unwrap();
        }
        let mut stream = Vec::new();
        write_head(&mut stream, "python", from.path()).unwrap();
        stream.extend_from_slice(b"ZFS SEND STREAM");

        let to = tempfile::tempdir().unwrap();
        let mut input = stream.as_slice();
        assert_eq!(read_head(&mut input, to.path()).unwrap(), "python");
        assert_eq!(input, b"ZFS SEND STREAM");
        for name in FILES {
            assert_eq!(std::fs::read(to.path().join(name)).unwrap(), std::fs::read(from.path().join(name)).unwrap());
        }
    }

    #[test]
    fn refuses_other_streams_and_file_names() {
        let to = tempfile::tempdir().unwrap();
        assert!(read_head(&mut &b"tar stream"[..], to.path()).is_err());
        let evil = r#"{"format":"copse-bhyve-snapshot","version":1,"template":"t","files":[["../x",1]]}"#;
        assert!(read_head(&mut format!("{evil}\nx").as_bytes(), to.path()).is_err());
        let short = r#"{"format":"copse-bhyve-snapshot","version":1,"template":"t","files":[["vm.ckp",9],["vm.ckp.kern",0],["vm.ckp.meta",0]]}"#;
        assert!(read_head(&mut format!("{short}\nxy").as_bytes(), to.path()).is_err());
    }
}
