//! A test that cannot run here reports itself skipped through `pegaflow_test_skip::skip!`,
//! whose line `scripts/test.sh` counts as skipped; a skip printed by hand (`println!("SKIP:
//! ...")`) is captured by cargo and the test counts as passed, unseen. This scans every Rust
//! file of the workspace for such prints.

use std::path::Path;

/// Whether `line` prints (`print!`, `println!`, `eprint!`, `eprintln!`) a literal that starts
/// with "skip", in any case.
fn prints_a_skip(line: &str) -> bool {
    ["print!(\"", "println!(\"", "eprint!(\"", "eprintln!(\""]
        .iter()
        .any(|m| {
            line.match_indices(m).any(|(i, _)| {
                line[i + m.len()..]
                    .get(..4)
                    .is_some_and(|w| w.eq_ignore_ascii_case("skip"))
            })
        })
}

fn scan(dir: &Path, hits: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if path.is_dir() {
            if !matches!(
                name.as_str(),
                "target" | "fuzz" | ".venv" | ".git" | "test-skip" | "node_modules"
            ) {
                scan(&path, hits);
            }
            continue;
        }
        if !name.ends_with(".rs") {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for (i, line) in text.lines().enumerate() {
            if prints_a_skip(line) {
                hits.push(format!("{}:{}: {}", path.display(), i + 1, line.trim()));
            }
        }
    }
}

#[test]
fn every_skip_goes_through_the_helper() {
    assert!(prints_a_skip(r#"    println!("SKIP: no redis");"#));
    assert!(prints_a_skip(r#"eprintln!("skipped: {why}");"#));
    assert!(!prints_a_skip(
        r#"eprintln!("the server used {cpu:.2} s");"#
    ));
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
    let mut hits = Vec::new();
    scan(root, &mut hits);
    // This file names the pattern in its checks above.
    hits.retain(|h| !h.contains("skips_are_reported.rs"));
    assert!(
        hits.is_empty(),
        "skips printed by hand (use pegaflow_test_skip::skip! or skip_part!, which scripts/test.sh counts):\n{}",
        hits.join("\n")
    );
}
