//! Every `FERRITE_*` name used anywhere in the code or scripts is declared in the registry.

use std::path::Path;

fn scan(dir: &Path, found: &mut Vec<(String, String)>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if path.is_dir() {
            if name != "target" && !name.starts_with('.') {
                scan(&path, found);
            }
        } else if [".rs", ".sh", ".py"].iter().any(|e| name.ends_with(e)) {
            let text = std::fs::read_to_string(&path).unwrap_or_default();
            let bytes = text.as_bytes();
            let mut i = 0;
            while let Some(off) = text[i..].find("FERRITE_") {
                let start = i + off;
                let mut end = start + "FERRITE_".len();
                while end < bytes.len() && (bytes[end].is_ascii_uppercase() || bytes[end].is_ascii_digit() || bytes[end] == b'_') {
                    end += 1;
                }
                let word = &text[start..end];
                // Skip prefixes in prose like `FERRITE_*` and names glued to other identifiers.
                let glued = start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
                if end > start + "FERRITE_".len() && !word.ends_with('_') && !glued {
                    found.push((word.to_string(), path.display().to_string()));
                }
                i = end;
            }
        }
    }
}

#[test]
fn every_used_switch_is_declared() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut found = Vec::new();
    for dir in ["crates", "scripts", ".ci"] {
        scan(&root.join(dir), &mut found);
    }
    assert!(found.iter().any(|(w, _)| w == "FERRITE_THREADS"), "the scan found nothing: wrong root?");
    let missing: Vec<_> = found.iter().filter(|(w, _)| ferrite_core::env::find(w).is_none()).collect();
    assert!(missing.is_empty(), "switches used but not declared in crates/ferrite-core/src/env.rs: {missing:?}");
}
