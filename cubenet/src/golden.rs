//! Golden files (`tests/golden/`): the renderers' and plans' expected
//! output, compared byte for byte by the unit tests of both backends.

/// Compares with the file under `tests/golden/`; `COPSE_BLESS=1`
/// rewrites it (review the diff before committing).
pub fn check(name: &str, actual: &str) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden").join(name);
    if std::env::var_os("COPSE_BLESS").is_some() {
        std::fs::write(&path, actual).unwrap();
    }
    let expected = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    assert_eq!(actual, expected, "{name} differs from its golden file");
}
