//! The Kubernetes manifest of docs/deployment.md validates against the Kubernetes 1.33 API
//! schemas with kubernetes-validate (strict: unknown fields are errors), and the validator does
//! catch a misspelt field in it. Needs `pip install kubernetes-validate` (`.ci/run` installs it).

use std::path::Path;
use std::process::Command;

fn validate(file: &Path) -> (bool, String) {
    let out = Command::new("python3")
        .args(["-m", "kubernetes_validate", "--strict", "-k", "1.33.0"])
        .arg(file)
        .output()
        .expect("python3 must be installed");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(!text.contains("No module named"), "kubernetes-validate is missing: pip install kubernetes-validate\n{text}");
    (out.status.success(), text)
}

#[test]
fn kubernetes_manifest_validates_and_a_typo_does_not() {
    let manifest = deco_tests::workspace_root().join("docs/deployment/deco.yaml");
    let (ok, text) = validate(&manifest);
    assert!(ok, "{text}");
    assert!(text.contains("deployment/deco") && text.contains("service/deco"), "both objects must be checked: {text}");
    let yaml = std::fs::read_to_string(&manifest).expect("read manifest");
    assert!(yaml.contains("path: /health"), "the readiness probe must use /health");
    let dir = tempfile::tempdir().expect("tempdir");
    let bad = dir.path().join("bad.yaml");
    std::fs::write(&bad, yaml.replace("readinessProbe:", "readinesProbe:")).expect("write");
    let (ok, text) = validate(&bad);
    assert!(!ok && text.contains("readinesProbe"), "a misspelt field must be refused: {text}");
}
