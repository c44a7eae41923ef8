//! A manifest checked against a CustomResourceDefinition's `openAPIV3Schema`, as the API server
//! checks it on create (defaults applied first, unknown fields refused as with strict field
//! validation), for `tests/helm_chart.rs`. Covered: `type`, `properties`, `required`,
//! `additionalProperties`, `enum`, `minimum`/`maximum`, `minLength`/`maxLength`,
//! `minItems`/`maxItems`, `minProperties`/`maxProperties`, `default`; a `pattern` or an
//! `x-kubernetes-validations` (CEL) rule is checked by a hand-written equivalent of the ones the
//! vendored CRD uses, and one this check does not know is an error, so that a newer CRD is noticed
//! rather than passed.

use serde_json::Value;

/// What is wrong with `doc` as an object of `crd`: its group, version and kind, then its schema.
/// Each problem names the field; empty when the API server would accept it.
pub fn validate_against_crd(crd: &Value, doc: &Value) -> Vec<String> {
    let spec = &crd["spec"];
    let group = spec["group"].as_str().unwrap_or_default();
    let api_version = doc["apiVersion"].as_str().unwrap_or_default();
    let Some(version) = api_version
        .strip_prefix(group)
        .and_then(|v| v.strip_prefix('/'))
    else {
        return vec![format!(
            "apiVersion {api_version:?} is not of group {group}"
        )];
    };
    let kind = &spec["names"]["kind"];
    if doc["kind"] != *kind {
        return vec![format!("kind {} is not {kind}", doc["kind"])];
    }
    let served = spec["versions"]
        .as_array()
        .into_iter()
        .flatten()
        .find(|v| v["name"] == version && v["served"] == true);
    let Some(served) = served else {
        return vec![format!("version {version} is not served")];
    };
    let mut problems = Vec::new();
    check(&served["schema"]["openAPIV3Schema"], doc, "", &mut problems);
    problems
}

fn join(path: &str, field: &str) -> String {
    if path.is_empty() {
        field.to_owned()
    } else {
        format!("{path}.{field}")
    }
}

fn check(schema: &Value, value: &Value, path: &str, problems: &mut Vec<String>) {
    if let Some(allowed) = schema["enum"].as_array() {
        if !allowed.contains(value) {
            problems.push(format!("{path}: {value} is not one of {allowed:?}"));
        }
    }
    match schema["type"].as_str() {
        Some("object") => check_object(schema, value, path, problems),
        Some("array") => check_array(schema, value, path, problems),
        Some("string") => check_string(schema, value, path, problems),
        Some("integer") => check_integer(schema, value, path, problems),
        Some("boolean") if value.is_boolean() => {}
        Some("boolean") => problems.push(format!("{path}: {value} is not a boolean")),
        other => problems.push(format!(
            "{path}: schema type {other:?} not known to this check"
        )),
    }
}

fn check_object(schema: &Value, value: &Value, path: &str, problems: &mut Vec<String>) {
    let Some(given) = value.as_object() else {
        problems.push(format!("{path}: {value} is not an object"));
        return;
    };
    // The API server applies defaults before it validates (CEL rules see them).
    let mut object = given.clone();
    let properties = schema["properties"].as_object();
    for (name, property) in properties.into_iter().flatten() {
        if let Some(default) = property.get("default") {
            object
                .entry(name.clone())
                .or_insert_with(|| default.clone());
        }
    }
    for name in schema["required"].as_array().into_iter().flatten() {
        let name = name.as_str().unwrap_or_default();
        if !object.contains_key(name) {
            problems.push(format!("{}: required", join(path, name)));
        }
    }
    let free_form = properties.is_none() && schema.get("additionalProperties").is_none();
    for (name, field) in &object {
        let at = join(path, name);
        match (
            properties.and_then(|p| p.get(name)),
            schema.get("additionalProperties"),
        ) {
            (Some(property), _) | (None, Some(property)) => check(property, field, &at, problems),
            // `type: object` with nothing more: `metadata`, checked by the API server itself.
            (None, None) if free_form => {}
            (None, None) => problems.push(format!("{at}: unknown field")),
        }
    }
    let count = object.len() as u64;
    if schema["minProperties"]
        .as_u64()
        .is_some_and(|min| count < min)
    {
        problems.push(format!(
            "{path}: fewer than {} entries",
            schema["minProperties"]
        ));
    }
    if schema["maxProperties"]
        .as_u64()
        .is_some_and(|max| count > max)
    {
        problems.push(format!(
            "{path}: more than {} entries",
            schema["maxProperties"]
        ));
    }
    check_rules(schema, &Value::Object(object), path, problems);
}

fn check_array(schema: &Value, value: &Value, path: &str, problems: &mut Vec<String>) {
    let Some(items) = value.as_array() else {
        problems.push(format!("{path}: {value} is not a list"));
        return;
    };
    for (i, item) in items.iter().enumerate() {
        check(&schema["items"], item, &format!("{path}[{i}]"), problems);
    }
    let count = items.len() as u64;
    if schema["minItems"].as_u64().is_some_and(|min| count < min) {
        problems.push(format!("{path}: fewer than {} items", schema["minItems"]));
    }
    if schema["maxItems"].as_u64().is_some_and(|max| count > max) {
        problems.push(format!("{path}: more than {} items", schema["maxItems"]));
    }
    check_rules(schema, value, path, problems);
}

fn check_string(schema: &Value, value: &Value, path: &str, problems: &mut Vec<String>) {
    let Some(text) = value.as_str() else {
        problems.push(format!("{path}: {value} is not a string"));
        return;
    };
    let length = text.chars().count() as u64;
    if schema["minLength"].as_u64().is_some_and(|min| length < min) {
        problems.push(format!("{path}: shorter than {}", schema["minLength"]));
    }
    if schema["maxLength"].as_u64().is_some_and(|max| length > max) {
        problems.push(format!("{path}: longer than {}", schema["maxLength"]));
    }
    if let Some(pattern) = schema["pattern"].as_str() {
        match matches_pattern(pattern, text) {
            Some(true) => {}
            Some(false) => problems.push(format!("{path}: {text:?} does not match {pattern}")),
            None => problems.push(format!("{path}: pattern {pattern} not known to this check")),
        }
    }
}

fn check_integer(schema: &Value, value: &Value, path: &str, problems: &mut Vec<String>) {
    let Some(n) = value.as_i64() else {
        problems.push(format!("{path}: {value} is not an integer"));
        return;
    };
    if schema["minimum"].as_i64().is_some_and(|min| n < min) {
        problems.push(format!("{path}: {n} is below {}", schema["minimum"]));
    }
    if schema["maximum"].as_i64().is_some_and(|max| n > max) {
        problems.push(format!("{path}: {n} is above {}", schema["maximum"]));
    }
}

/// `x-kubernetes-validations`: each CEL rule by its hand-written equivalent.
fn check_rules(schema: &Value, value: &Value, path: &str, problems: &mut Vec<String>) {
    for rule in schema["x-kubernetes-validations"]
        .as_array()
        .into_iter()
        .flatten()
    {
        let text = rule["rule"].as_str().unwrap_or_default();
        let holds = match text {
            "self.kind != 'Service' || has(self.port)" => {
                value["kind"] != "Service" || value.get("port").is_some()
            }
            "self.all(p1, self.exists_one(p2, p1.number==p2.number))" => {
                let items = value.as_array().cloned().unwrap_or_default();
                items.iter().all(|p1| {
                    items
                        .iter()
                        .filter(|p2| p1["number"] == p2["number"])
                        .count()
                        == 1
                })
            }
            _ => {
                problems.push(format!("{path}: rule {text:?} not known to this check"));
                continue;
            }
        };
        if !holds {
            problems.push(format!("{path}: {}", rule["message"]));
        }
    }
}

/// `text` is non-empty, starts with `first`, ends with `last`, and has only `inner` between.
fn shaped(
    text: &str,
    first: impl Fn(char) -> bool,
    inner: impl Fn(char) -> bool,
    last: impl Fn(char) -> bool,
) -> bool {
    let chars: Vec<char> = text.chars().collect();
    match chars.as_slice() {
        [] => false,
        [only] => first(*only) && last(*only),
        [head, middle @ .., tail] => {
            first(*head) && last(*tail) && middle.iter().all(|&c| inner(c))
        }
    }
}

/// A DNS label (RFC 1123): lower-case letters, digits and inner dashes.
fn dns_label(text: &str) -> bool {
    let alnum = |c: char| c.is_ascii_lowercase() || c.is_ascii_digit();
    shaped(text, alnum, |c| alnum(c) || c == '-', alnum)
}

/// The patterns of the vendored CRD, each by its hand-written equivalent; `None`: a pattern this
/// check does not know.
fn matches_pattern(pattern: &str, text: &str) -> Option<bool> {
    let alnum = |c: char| c.is_ascii_alphanumeric();
    Some(match pattern {
        // A DNS subdomain or empty (an API group).
        r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$" => {
            text.is_empty() || text.split('.').all(dns_label)
        }
        r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$" => dns_label(text),
        // A kind.
        r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$" => shaped(
            text,
            |c| c.is_ascii_alphabetic(),
            |c| alnum(c) || c == '-',
            alnum,
        ),
        // A label value, possibly empty.
        r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$" => {
            text.is_empty() || shaped(text, alnum, |c| alnum(c) || "-_.".contains(c), alnum)
        }
        _ => return None,
    })
}

#[test]
fn the_hand_written_patterns_agree_with_their_regular_expressions() {
    let group = r"^$|^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$";
    let kind = r"^[a-zA-Z]([-a-zA-Z0-9]*[a-zA-Z0-9])?$";
    let label = r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$";
    let cases = [
        (group, "", true),
        (group, "inference.networking.k8s.io", true),
        (group, "a", true),
        (group, "Inference.io", false),
        (group, "a..b", false),
        (group, "-a.io", false),
        (kind, "Service", true),
        (kind, "S", true),
        (kind, "1Service", false),
        (kind, "Service-", false),
        (kind, "", false),
        (label, "", true),
        (label, "vllm-qwen3", true),
        (label, "my.name_1", true),
        (label, "-x", false),
        (label, "x_", false),
        (label, "a b", false),
    ];
    for (pattern, text, expected) in cases {
        assert_eq!(
            matches_pattern(pattern, text),
            Some(expected),
            "{pattern} {text:?}"
        );
    }
    assert_eq!(matches_pattern("^x+$", "x"), None);
}
