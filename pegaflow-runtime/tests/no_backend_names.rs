//! The runtime never names a backend: no string literal in its non-test code holds a backend
//! kind as a whole word (kinds are made of letters, digits, `-` and `_`; case matters, so
//! prose such as "host DRAM" is not a kind). Backends declare what the runtime needs
//! (capabilities, flags, the default landing tier) instead.
//!
//! Line-based: comment lines are skipped, and so is everything from a line starting with
//! `#[cfg(test)]` to the end of the file (test modules come last), and a test module in a
//! file of its own (`tests.rs` beside a `mod.rs` that declares it under `#[cfg(test)]`).

use std::path::Path;

const KINDS: &[&str] = &[
    "dram",
    "ssd",
    "rdma",
    "tcp",
    "cuda",
    "cuda-ipc",
    "cuda-vmm",
    "host-memfd",
    "memfd",
    "memcpy",
    "shm",
    "vmm",
    "heap-store",
    "redis",
    "metaserver",
];

fn is_word_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '-' || c == '_'
}

/// The string literals of one line of code (escapes kept as written; a literal that spans
/// lines is cut at the line end, which only makes the check stricter).
fn literals(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut chars = line.chars().peekable();
    let mut prev = ' ';
    while let Some(c) = chars.next() {
        // A `"` right after `'` is the char literal '"', not the start of a string.
        if c == '"' && prev != '\'' {
            let mut lit = String::new();
            let mut escaped = false;
            for d in chars.by_ref() {
                if escaped {
                    escaped = false;
                } else if d == '\\' {
                    escaped = true;
                } else if d == '"' {
                    break;
                }
                lit.push(d);
            }
            out.push(lit);
        } else if c == '/' && chars.peek() == Some(&'/') {
            break;
        }
        prev = c;
    }
    out
}

fn names_a_kind(lit: &str) -> Option<&'static str> {
    lit.split(|c: char| !is_word_char(c))
        .find_map(|word| KINDS.iter().find(|k| **k == word).copied())
}

fn scan(dir: &Path, hits: &mut Vec<String>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            scan(&path, hits);
            continue;
        }
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        // A test module in a file of its own (`mod.rs` declares `#[cfg(test)] mod tests;`).
        if path.file_name().is_some_and(|n| n == "tests.rs")
            && std::fs::read_to_string(path.with_file_name("mod.rs"))
                .is_ok_and(|m| m.contains("#[cfg(test)]\nmod tests;"))
        {
            continue;
        }
        let text = std::fs::read_to_string(&path).unwrap();
        for (i, line) in text.lines().enumerate() {
            let code = line.trim_start();
            if code.starts_with("#[cfg(test)]") {
                break;
            }
            if code.starts_with("//") {
                continue;
            }
            for lit in literals(line) {
                if let Some(kind) = names_a_kind(&lit) {
                    hits.push(format!("{}:{}: {kind:?} in {lit:?}", path.display(), i + 1));
                }
            }
        }
    }
}

#[test]
fn no_string_literal_in_the_runtime_names_a_backend() {
    let mut hits = Vec::new();
    scan(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src"),
        &mut hits,
    );
    assert!(
        hits.is_empty(),
        "backend kinds named in pegaflow-runtime/src:\n{}",
        hits.join("\n")
    );
}

#[test]
fn the_scanner_finds_kinds_as_whole_words_only() {
    assert_eq!(names_a_kind("the dram tier"), Some("dram"));
    assert_eq!(names_a_kind("tiers/ssd"), Some("ssd"));
    assert_eq!(names_a_kind("kind = \\\"cuda-ipc\\\""), Some("cuda-ipc"));
    assert_eq!(names_a_kind("--ssd-cache-path"), None);
    assert_eq!(names_a_kind("test-memcpy"), None);
    assert_eq!(names_a_kind("host DRAM"), None);
    assert_eq!(
        literals(r#"let x = "a \"dram\" b"; // "memcpy""#),
        vec![r#"a \"dram\" b"#.to_string()]
    );
}
