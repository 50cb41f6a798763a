//! The MCP server: tool `run_network_tool` and resource `mcp-run://capabilities`, over
//! streamable HTTP at `/mcp` (nested in the gateway's router) and over stdio
//! (`mcp-run stdio`). Every call goes through [`Runner::start`], the same entry point as
//! `/raw`, so limits, timeouts and backends behave the same.

pub mod config;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rmcp::ErrorData as McpError;
use rmcp::model::{
    CallToolRequestParams, CallToolResponse, CallToolResult, ContentBlock, ListResourcesResult,
    ListToolsResult, PaginatedRequestParams, ProgressNotificationParam, ReadResourceRequestParams,
    ReadResourceResponse, ReadResourceResult, Resource, ResourceContents, ServerCapabilities,
    ServerConfig, Tool, ToolAnnotations,
};
use rmcp::service::RequestContext;
use rmcp::{RoleServer, ServerHandler};
use serde_json::{Value, json};

use crate::capabilities::{Capabilities, EXPERIMENTAL_KEY, RESOURCE_URI};
use crate::contract::{ErrorBody, ErrorCode, RunRequest};
use crate::result::{Stream, StructuredResult, collect};
use crate::runner::Runner;

/// The one built-in tool.
pub const TOOL: &str = "run_network_tool";

/// The tool's output schema: derived once, not on every tools/list and tools/call.
static OUTPUT_SCHEMA: std::sync::LazyLock<Value> = std::sync::LazyLock::new(|| {
    serde_json::to_value(schemars::schema_for!(StructuredResult)).unwrap_or_default()
});

/// How often progress notifications are sent at most.
const PROGRESS_EVERY: Duration = Duration::from_secs(1);

/// What an MCP session needs; cheap to clone (one per session).
#[derive(Clone)]
pub struct McpService {
    runner: Arc<Runner>,
    capabilities: Arc<Capabilities>,
    max_output_bytes: usize,
    /// Operator-declared CLI tools (config `tools:`).
    tools: Arc<Vec<crate::tools::ToolConfig>>,
    /// Output templates: the built-ins plus the nearest `.mcp-run/config.yaml` at or above
    /// `template_dir`, reloaded after a TTL.
    templates: Arc<crate::templates::TemplateStore>,
    template_dir: std::path::PathBuf,
}

impl McpService {
    pub fn new(
        runner: Arc<Runner>,
        capabilities: Arc<Capabilities>,
        max_output_bytes: usize,
    ) -> Self {
        Self {
            runner,
            capabilities,
            max_output_bytes,
            tools: Arc::new(Vec::new()),
            templates: Arc::new(crate::templates::TemplateStore::default()),
            template_dir: std::env::current_dir().unwrap_or_else(|_| "/".into()),
        }
    }

    /// Takes output templates from this store, configured for this directory (the
    /// process's current directory by default).
    pub fn with_templates(
        mut self,
        store: Arc<crate::templates::TemplateStore>,
        dir: std::path::PathBuf,
    ) -> Self {
        self.templates = store;
        self.template_dir = dir;
        self
    }

    /// Serves these operator-declared CLI tools too, each as its own MCP tool.
    pub fn with_tools(mut self, tools: Arc<Vec<crate::tools::ToolConfig>>) -> Self {
        self.tools = tools;
        self
    }

    /// The MCP definition of a declared CLI tool.
    fn cli_tool(&self, t: &crate::tools::ToolConfig) -> Tool {
        let mut description = format!("{} Runs `{}`", t.description.trim_end(), t.usage());
        if let Some(a) = &t.args {
            description.push_str(&format!("; positional arguments: {}", a.description));
        }
        description.push_str(&format!(
            ". {} Result: {{stdout, stderr, exitCode}}.",
            self.capabilities.where_line()
        ));
        let mut tool = Tool::new(t.name.clone(), description, t.input_schema());
        tool.output_schema = Some(Arc::new(crate::tools::output_schema()));
        tool.annotations = Some(
            ToolAnnotations::with_title(t.name.clone())
                .read_only(false)
                .destructive(true)
                .idempotent(false)
                .open_world(true),
        );
        tool
    }

    /// Runs a declared CLI tool: an input or start failure is an execution error (`isError`,
    /// the reason, no output); a command that ran gives `{stdout, stderr, exitCode}`, with
    /// `isError` when the exit code is not 0 (a command error).
    async fn run_cli_tool(
        &self,
        t: &crate::tools::ToolConfig,
        arguments: Option<serde_json::Map<String, Value>>,
        context: RequestContext<RoleServer>,
    ) -> CallToolResult {
        // The template is resolved first: an unknown name runs nothing.
        let template = match &t.template {
            None => None,
            Some(name) => {
                match self.template(name, &format!("tool {} names the unknown template", t.name)) {
                    Ok(tpl) => Some(tpl),
                    Err(e) => return error_result(&e),
                }
            }
        };
        let req = match t.request(&arguments.unwrap_or_default()) {
            Ok(r) => r,
            Err(e) => {
                return error_result(&ErrorBody::new(
                    ErrorCode::InvalidRequest,
                    format!("invalid input for {}: {e}", t.name),
                ));
            }
        };
        let caller = crate::auth::mcp_caller(&context.extensions)
            .unwrap_or_else(|| crate::auth::Caller::local("stdio"));
        let started = tokio::select! {
            s = self.runner.start_as(req, &caller) => s,
            _ = context.ct.cancelled() => Err(ErrorBody::new(ErrorCode::InvalidRequest, "cancelled by the client")),
        };
        let execution = match started {
            Ok(e) => e,
            Err(e) => return error_result(&e),
        };
        let collected = tokio::select! {
            c = collect(execution, self.max_output_bytes, |_, _| {}) => c,
            _ = context.ct.cancelled() => {
                return error_result(&ErrorBody::new(
                    ErrorCode::InvalidRequest,
                    "cancelled by the client: the command was killed",
                ));
            }
        };
        if let Some(e) = &collected.error {
            return error_result(e);
        }
        let exit_code = collected
            .exit
            .map(|e| if e.timed_out { 124 } else { e.shell_status() })
            .unwrap_or(255);
        let (mut stdout, mut stderr) = (collected.stdout.text().0, collected.stderr.text().0);
        if let Some(tpl) = &template {
            for s in [&mut stdout, &mut stderr] {
                let f = tpl.apply(s.as_bytes(), Some(exit_code));
                *s = String::from_utf8_lossy(&f.output).into_owned();
            }
        }
        let output = json!({
            "stdout": stdout,
            "stderr": stderr,
            "exitCode": exit_code,
        });
        let content = vec![ContentBlock::text(
            serde_json::to_string_pretty(&output).unwrap_or_default(),
        )];
        let mut result = if exit_code == 0 {
            CallToolResult::success(content)
        } else {
            CallToolResult::error(content)
        };
        result.structured_content = Some(output);
        result
    }

    /// The tool's definition: input schema with the profiles as an enum, the
    /// StructuredResult schema as output schema, annotations saying what it does.
    pub fn tool(&self) -> Tool {
        let caps = &self.capabilities;
        let profiles: Vec<String> = caps
            .backend
            .profiles
            .iter()
            .map(|p| p.name.clone())
            .collect();
        let input = json!({
            "type": "object",
            "additionalProperties": false,
            "required": ["executable"],
            "properties": {
                "executable": {
                    "type": "string", "minLength": 1,
                    "description": "The program to run, looked up in the runner's PATH (or an absolute path). Not a shell command line: pass arguments in `args`, and use executable `sh` with args [\"-c\", \"...\"] when you need a shell."
                },
                "args": {"type": "array", "items": {"type": "string"}, "description": "Arguments, passed unchanged as argv."},
                "cwd": {"type": "string", "description": "Working directory on the runner."},
                "env": {"type": "object", "additionalProperties": {"type": "string"}, "description": "Environment variables for the command (names: letters, digits, underscore)."},
                "timeout_secs": {
                    "type": "integer", "minimum": 1, "maximum": caps.limits.max_timeout_secs,
                    "description": format!("Kill the command after this many seconds (default {}).", caps.limits.default_timeout_secs)
                },
                "profile": {
                    "type": "string", "enum": profiles,
                    "description": "The runner profile (image, resources) to run in; default `default`."
                }
            }
        });
        let catalog = self.templates.catalog(&self.template_dir);
        let listing: Vec<String> = catalog
            .entries()
            .map(|(t, _)| format!("`{}`: {}", t.name, t.description))
            .collect();
        let mut input = input;
        input["properties"]["template"] = json!({
            "type": "string", "enum": catalog.names(),
            "description": format!(
                "Filter stdout and stderr down to errors and summary after the command ends (default: the raw output). On a failure, error lines and their locations are always kept. {}",
                listing.join("; ")
            )
        });
        // Workspaces (docs/workspaces.md), when this gateway takes them.
        if self.runner.workspaces().is_some() {
            input["properties"]["workspace"] = json!({
                "type": "string",
                "description": "A workspace id returned by POST /workspaces (docs/workspaces.md): the command runs in a fresh copy of that tree, and `cwd` is relative to its root."
            });
        }
        let output = OUTPUT_SCHEMA.clone();
        let description = format!(
            "Run a command and get its stdout, stderr and exit code. {} Limits: timeout up to {} s (default {} s); no stdin, no TTY; each stream is capped at {} KiB in the result (head and tail kept).",
            caps.where_line(),
            caps.limits.max_timeout_secs,
            caps.limits.default_timeout_secs,
            self.max_output_bytes / 1024,
        );
        let mut tool = Tool::new(TOOL, description, as_object(input));
        tool.output_schema = Some(Arc::new(as_object(output)));
        tool.annotations = Some(
            ToolAnnotations::with_title("Run a command on mcp-run")
                .read_only(false)
                .destructive(true)
                .idempotent(false)
                .open_world(true),
        );
        tool
    }

    /// The template `name`, or an error that starts with `unknown` and lists what there is.
    fn template(&self, name: &str, unknown: &str) -> Result<crate::templates::Template, ErrorBody> {
        self.templates.get(name, &self.template_dir).ok_or_else(|| {
            ErrorBody::new(
                ErrorCode::InvalidRequest,
                format!(
                    "{unknown} {name:?}; available: {}",
                    self.templates.names(&self.template_dir).join(", ")
                ),
            )
        })
    }

    async fn run(
        &self,
        arguments: Option<serde_json::Map<String, Value>>,
        context: RequestContext<RoleServer>,
    ) -> CallToolResult {
        let mut arguments = arguments.unwrap_or_default();
        // `template` is ours, not the runner's: resolve it before anything runs.
        let template = match arguments.remove("template") {
            None | Some(Value::Null) => None,
            Some(Value::String(name)) => match self.template(&name, "unknown template") {
                Ok(t) => Some(t),
                Err(e) => return error_result(&e),
            },
            Some(other) => {
                return error_result(&ErrorBody::new(
                    ErrorCode::InvalidRequest,
                    format!("invalid arguments: template must be a string, not {other}"),
                ));
            }
        };
        let args = Value::Object(arguments);
        let req: RunRequest = match serde_json::from_value(args) {
            Ok(r) => r,
            Err(e) => {
                return error_result(&ErrorBody::new(
                    ErrorCode::InvalidRequest,
                    format!("invalid arguments: {e}"),
                ));
            }
        };
        // Over HTTP the gateway's middleware identified the caller; over stdio it is local.
        let caller = crate::auth::mcp_caller(&context.extensions)
            .unwrap_or_else(|| crate::auth::Caller::local("stdio"));
        let started = tokio::select! {
            s = self.runner.start_as(req.clone(), &caller) => s,
            _ = context.ct.cancelled() => Err(ErrorBody::new(ErrorCode::InvalidRequest, "cancelled by the client")),
        };
        let execution = match started {
            Ok(e) => e,
            Err(e) => {
                let r = StructuredResult::not_started(TOOL, &self.runner.redact_request(&req), &e);
                return finish(r);
            }
        };
        // Progress: the latest output line, at most once a second, when asked for.
        let latest = Arc::new(Mutex::new(String::new()));
        let progress = context.meta.get_progress_token().map(|token| {
            let peer = context.peer.clone();
            let latest = latest.clone();
            let begun = Instant::now();
            tokio::spawn(async move {
                let mut tick = tokio::time::interval(PROGRESS_EVERY);
                tick.tick().await;
                loop {
                    tick.tick().await;
                    let line = latest.lock().map(|l| l.clone()).unwrap_or_default();
                    let elapsed = begun.elapsed().as_secs_f64();
                    let mut p = ProgressNotificationParam::new(token.clone(), elapsed.floor());
                    p = p.with_message(if line.is_empty() {
                        format!("running for {elapsed:.0} s")
                    } else {
                        format!("running for {elapsed:.0} s: {line}")
                    });
                    if peer.notify_progress(p).await.is_err() {
                        return;
                    }
                }
            })
        });
        let on_output = |_: Stream, data: &[u8]| {
            if let Some(line) = last_line(data)
                && let Ok(mut l) = latest.lock()
            {
                *l = line;
            }
        };
        let cap = self.max_output_bytes;
        let collected = tokio::select! {
            c = collect(execution, cap, on_output) => Some(c),
            // Dropping the execution kills the command (and deletes its pod).
            _ = context.ct.cancelled() => None,
        };
        if let Some(p) = progress {
            p.abort();
        }
        match collected {
            Some(c) => {
                let mut r = StructuredResult::from_run(TOOL, &self.runner.redact_request(&req), &c);
                if let Some(t) = &template {
                    crate::templates::apply_to_result(&mut r, t);
                }
                finish(r)
            }
            None => error_result(&ErrorBody::new(
                ErrorCode::InvalidRequest,
                "cancelled by the client: the command was killed",
            )),
        }
    }

    fn capabilities_json(&self) -> Value {
        serde_json::to_value(self.capabilities.as_ref()).unwrap_or_default()
    }
}

/// The last non-empty line of a chunk, shortened for a progress message.
fn last_line(data: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(data);
    let line = text.lines().rev().find(|l| !l.trim().is_empty())?.trim();
    Some(line.chars().take(200).collect())
}

fn as_object(v: Value) -> serde_json::Map<String, Value> {
    match v {
        Value::Object(m) => m,
        _ => serde_json::Map::new(),
    }
}

/// A tool result: markdown content, the StructuredResult as structured content, `isError`
/// unless the command exited 0.
fn finish(r: StructuredResult) -> CallToolResult {
    let content = vec![ContentBlock::text(r.to_markdown())];
    let mut result = if r.success {
        CallToolResult::success(content)
    } else {
        CallToolResult::error(content)
    };
    result.structured_content = serde_json::to_value(&r).ok();
    result
}

/// A call that never reached a command (bad arguments, cancelled).
fn error_result(e: &ErrorBody) -> CallToolResult {
    CallToolResult::error(vec![ContentBlock::text(format!(
        "{}: {}",
        e.code, e.message
    ))])
}

impl ServerHandler for McpService {
    fn get_info(&self) -> ServerConfig {
        let mut experimental = std::collections::BTreeMap::new();
        experimental.insert(
            EXPERIMENTAL_KEY.to_string(),
            as_object(self.capabilities_json()),
        );
        let mut caps = ServerCapabilities::builder()
            .enable_tools()
            .enable_resources()
            .enable_experimental()
            .build();
        caps.experimental = Some(experimental);
        ServerConfig::new(caps)
            .with_server_info(rmcp::model::Implementation::new("mcp-run", env!("CARGO_PKG_VERSION")))
            .with_instructions(format!(
                "Use `{TOOL}` to run commands. {} The document `{RESOURCE_URI}` describes the runtime, its limits and policy.",
                self.capabilities.where_line()
            ))
    }

    async fn list_tools(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListToolsResult, McpError> {
        let mut tools = vec![self.tool()];
        tools.extend(self.tools.iter().map(|t| self.cli_tool(t)));
        Ok(ListToolsResult::with_all_items(tools))
    }

    fn get_tool(&self, name: &str) -> Option<Tool> {
        if name == TOOL {
            return Some(self.tool());
        }
        self.tools
            .iter()
            .find(|t| t.name == name)
            .map(|t| self.cli_tool(t))
    }

    async fn call_tool(
        &self,
        request: CallToolRequestParams,
        context: RequestContext<RoleServer>,
    ) -> Result<CallToolResponse, McpError> {
        if let Some(t) = self.tools.iter().find(|t| t.name == request.name) {
            let t = t.clone();
            return Ok(self
                .run_cli_tool(&t, request.arguments, context)
                .await
                .into());
        }
        if request.name != TOOL {
            return Err(McpError::invalid_params(
                format!("unknown tool {:?}", request.name),
                None,
            ));
        }
        Ok(self.run(request.arguments, context).await.into())
    }

    async fn list_resources(
        &self,
        _request: Option<PaginatedRequestParams>,
        _context: RequestContext<RoleServer>,
    ) -> Result<ListResourcesResult, McpError> {
        Ok(ListResourcesResult::with_all_items(vec![
            Resource::new(RESOURCE_URI, "capabilities")
                .with_title("mcp-run runtime capabilities")
                .with_description("Where commands run (backend, namespace, profiles, images), the limits, the policy and the templates on offer.")
                .with_mime_type("application/json"),
        ]))
    }

    async fn read_resource(
        &self,
        request: ReadResourceRequestParams,
        _context: RequestContext<RoleServer>,
    ) -> Result<ReadResourceResponse, McpError> {
        if request.uri != RESOURCE_URI {
            return Err(McpError::resource_not_found(
                format!("no resource {:?}", request.uri),
                None,
            ));
        }
        let text = serde_json::to_string_pretty(&self.capabilities_json()).unwrap_or_default();
        Ok(ReadResourceResult::new(vec![ResourceContents::text(text, RESOURCE_URI)]).into())
    }
}
