//! The chart's renderer for `tests/helm_chart.rs`: Go templates by gtmpl, plus the Helm
//! functions the chart uses (`include`, `toYaml`, `nindent`, `indent`, `quote`, `default`,
//! `until`, `int`, `required`, `fail`, `replace`) and `.Files.Get` (gtmpl calls no method with
//! arguments, so `.Files.Get "f"` is read as a function `filesGet "f"`, from the chart's
//! directory as Helm reads it).

use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;

use gtmpl_value::{FuncError, Number, Value};
use serde_json::json;

pub fn chart_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("deploy/helm/kv-indexer")
}

fn to_gtmpl(v: &serde_json::Value) -> Value {
    match v {
        serde_json::Value::Null => Value::Nil,
        serde_json::Value::Bool(b) => Value::Bool(*b),
        serde_json::Value::Number(n) => match n.as_i64() {
            Some(i) => Value::Number(Number::from(i)),
            None => Value::Number(Number::from(n.as_f64().unwrap_or(0.0))),
        },
        serde_json::Value::String(s) => Value::String(s.clone()),
        serde_json::Value::Array(a) => Value::Array(a.iter().map(to_gtmpl).collect()),
        serde_json::Value::Object(o) => {
            Value::Map(o.iter().map(|(k, v)| (k.clone(), to_gtmpl(v))).collect())
        }
    }
}

fn to_json(v: &Value) -> serde_json::Value {
    match v {
        Value::Nil | Value::NoValue => serde_json::Value::Null,
        Value::Bool(b) => json!(b),
        Value::Number(n) => match n.as_i64() {
            Some(i) => json!(i),
            None => json!(n.as_f64()),
        },
        Value::String(s) => json!(s),
        Value::Array(a) => serde_json::Value::Array(a.iter().map(to_json).collect()),
        Value::Map(m) | Value::Object(m) => {
            let mut keys: Vec<_> = m.keys().collect();
            keys.sort();
            serde_json::Value::Object(
                keys.into_iter()
                    .map(|k| (k.clone(), to_json(&m[k])))
                    .collect(),
            )
        }
        Value::Function(_) => serde_json::Value::Null,
    }
}

fn truthy(v: &Value) -> bool {
    match v {
        Value::Nil | Value::NoValue => false,
        Value::Bool(b) => *b,
        Value::String(s) => !s.is_empty(),
        Value::Number(n) => n.as_f64().is_some_and(|f| f != 0.0),
        Value::Array(a) => !a.is_empty(),
        Value::Map(m) | Value::Object(m) => !m.is_empty(),
        Value::Function(_) => true,
    }
}

thread_local! {
    /// Named templates (`define`) pre-rendered with the root context, for `include`.
    static INCLUDES: RefCell<HashMap<String, String>> = RefCell::new(HashMap::new());
}

fn include(args: &[Value]) -> Result<Value, FuncError> {
    let Some(Value::String(name)) = args.first() else {
        return Err(FuncError::Generic("include needs a template name".into()));
    };
    INCLUDES
        .with(|m| m.borrow().get(name).cloned())
        .map(Value::String)
        .ok_or_else(|| FuncError::Generic(format!("no template {name}")))
}

fn to_yaml(args: &[Value]) -> Result<Value, FuncError> {
    let v = args.last().map(to_json).unwrap_or(serde_json::Value::Null);
    if v.is_null() || v == json!({}) || v == json!([]) {
        return Ok(Value::String(if v.is_array() { "[]" } else { "{}" }.into()));
    }
    let text = serde_yaml::to_string(&v).map_err(|e| FuncError::Generic(e.to_string()))?;
    Ok(Value::String(text.trim_end().to_owned()))
}

/// Helm's `indent N TEXT`: every line of TEXT after N spaces.
fn indent(args: &[Value]) -> Result<Value, FuncError> {
    let (Some(Value::Number(n)), Some(text)) = (args.first(), args.get(1)) else {
        return Err(FuncError::Generic("indent N TEXT".into()));
    };
    let pad = " ".repeat(n.as_i64().unwrap_or(0) as usize);
    let text = match text {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    };
    let body: Vec<String> = text.lines().map(|l| format!("{pad}{l}")).collect();
    Ok(Value::String(body.join("\n")))
}

/// Helm's `nindent N TEXT`: a newline, then `indent N TEXT`.
fn nindent(args: &[Value]) -> Result<Value, FuncError> {
    let Value::String(body) = indent(args)? else {
        return Err(FuncError::Generic("nindent N TEXT".into()));
    };
    Ok(Value::String(format!("\n{body}")))
}

/// Helm's `replace OLD NEW TEXT`.
fn replace(args: &[Value]) -> Result<Value, FuncError> {
    match args {
        [Value::String(old), Value::String(new), Value::String(text)] => {
            Ok(Value::String(text.replace(old.as_str(), new)))
        }
        _ => Err(FuncError::ExactlyXArgs("replace".into(), 3)),
    }
}

/// Helm's `.Files.Get PATH`: a file of the chart, as text (links followed, as Helm does).
fn files_get(args: &[Value]) -> Result<Value, FuncError> {
    let [Value::String(path)] = args else {
        return Err(FuncError::ExactlyXArgs(".Files.Get".into(), 1));
    };
    std::fs::read_to_string(chart_dir().join(path))
        .map(Value::String)
        .map_err(|e| FuncError::Generic(format!(".Files.Get {path}: {e}")))
}

fn quote(args: &[Value]) -> Result<Value, FuncError> {
    let s = match args.last() {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Nil) | Some(Value::NoValue) | None => String::new(),
        Some(other) => other.to_string(),
    };
    Ok(Value::String(serde_json::Value::String(s).to_string()))
}

fn default(args: &[Value]) -> Result<Value, FuncError> {
    match args {
        [fallback, given] if truthy(given) => Ok(given.clone()),
        [fallback, _] | [fallback] => Ok(fallback.clone()),
        _ => Err(FuncError::Generic("default FALLBACK VALUE".into())),
    }
}

fn until(args: &[Value]) -> Result<Value, FuncError> {
    let n = match args.first() {
        Some(Value::Number(n)) => n.as_i64().unwrap_or(0),
        _ => 0,
    };
    Ok(Value::Array(
        (0..n).map(|i| Value::Number(Number::from(i))).collect(),
    ))
}

fn int(args: &[Value]) -> Result<Value, FuncError> {
    match args.first() {
        Some(Value::Number(n)) => {
            let i = n
                .as_i64()
                .or_else(|| n.as_u64().map(|u| u as i64))
                .or_else(|| n.as_f64().map(|f| f as i64))
                .unwrap_or(0);
            Ok(Value::Number(Number::from(i)))
        }
        Some(Value::String(s)) => Ok(Value::Number(Number::from(s.parse::<i64>().unwrap_or(0)))),
        _ => Ok(Value::Number(Number::from(0i64))),
    }
}

/// Helm's `required MSG VALUE`: the value, or a render error with the message when it is empty.
fn required(args: &[Value]) -> Result<Value, FuncError> {
    match args {
        [Value::String(message), value] if !truthy(value) => {
            Err(FuncError::Generic(message.clone()))
        }
        [_, value] => Ok(value.clone()),
        _ => Err(FuncError::ExactlyXArgs("required".into(), 2)),
    }
}

/// Helm's `fail MSG`: a render error with the message.
fn fail(args: &[Value]) -> Result<Value, FuncError> {
    match args {
        [Value::String(message)] => Err(FuncError::Generic(message.clone())),
        _ => Err(FuncError::ExactlyXArgs("fail".into(), 1)),
    }
}

fn template(source: &str) -> gtmpl::Template {
    let mut t = gtmpl::Template::default();
    t.add_funcs(&[
        ("include", include as gtmpl::Func),
        ("toYaml", to_yaml as gtmpl::Func),
        ("indent", indent as gtmpl::Func),
        ("nindent", nindent as gtmpl::Func),
        ("replace", replace as gtmpl::Func),
        ("filesGet", files_get as gtmpl::Func),
        ("quote", quote as gtmpl::Func),
        ("default", default as gtmpl::Func),
        ("until", until as gtmpl::Func),
        ("int", int as gtmpl::Func),
        ("required", required as gtmpl::Func),
        ("fail", fail as gtmpl::Func),
    ]);
    t.parse(source.replace(".Files.Get ", "filesGet "))
        .unwrap_or_else(|e| panic!("template parse: {e}"));
    t
}

fn merge(base: &mut serde_json::Value, over: &serde_json::Value) {
    match (base, over) {
        (serde_json::Value::Object(b), serde_json::Value::Object(o)) => {
            for (k, v) in o {
                merge(b.entry(k.clone()).or_insert(serde_json::Value::Null), v);
            }
        }
        (b, o) => *b = o.clone(),
    }
}

/// Renders every template with `overrides` merged into values.yaml: (file, rendered YAML).
pub fn render(overrides: serde_json::Value) -> Vec<(String, serde_json::Value)> {
    let dir = chart_dir();
    let mut values: serde_json::Value =
        serde_yaml::from_str(&std::fs::read_to_string(dir.join("values.yaml")).expect("values"))
            .expect("yaml");
    merge(&mut values, &overrides);
    let chart: serde_json::Value =
        serde_yaml::from_str(&std::fs::read_to_string(dir.join("Chart.yaml")).expect("Chart"))
            .expect("yaml");
    let ctx = to_gtmpl(&json!({
        "Values": values,
        "Release": {"Name": "kvi", "Namespace": "inference", "Service": "Helm"},
        "Chart": {"Name": chart["name"], "Version": chart["version"], "AppVersion": chart["appVersion"]},
    }));
    let helpers = std::fs::read_to_string(dir.join("templates/_helpers.tpl")).expect("helpers");
    let names: Vec<String> = helpers
        .split("define \"")
        .skip(1)
        .filter_map(|s| s.split('"').next().map(str::to_owned))
        .collect();
    let pre: HashMap<String, String> = names
        .iter()
        .map(|n| {
            let t = template(&format!("{helpers}{{{{ template \"{n}\" . }}}}"));
            let out = t
                .render(&gtmpl::Context::from(ctx.clone()))
                .expect("helper renders");
            (n.clone(), out.trim().to_owned())
        })
        .collect();
    INCLUDES.with(|m| *m.borrow_mut() = pre);
    let mut out = Vec::new();
    let mut files: Vec<_> = std::fs::read_dir(dir.join("templates"))
        .expect("templates")
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    for path in files {
        let name = path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        let source = std::fs::read_to_string(&path).expect("template");
        let t = template(&format!("{helpers}{source}"));
        let rendered = t
            .render(&gtmpl::Context::from(ctx.clone()))
            .unwrap_or_else(|e| panic!("{name}: {e}"));
        if rendered.trim().is_empty() {
            continue;
        }
        let doc: serde_json::Value = serde_yaml::from_str(&rendered)
            .unwrap_or_else(|e| panic!("{name} is not YAML: {e}\n{rendered}"));
        out.push((name, doc));
    }
    out
}
