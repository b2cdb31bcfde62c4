// copse's JavaScript and TypeScript kernel: one Node.js process per code
// context, driven by copse_interpreter.py over its standard streams.
//
// Cells are evaluated by Node's own REPL evaluator, in the process's global
// context, so they behave as they do at a `node` prompt: declarations
// persist from cell to cell, the value of the last expression is the
// result, top-level `await` works, and `require` and dynamic `import()`
// load modules. TypeScript is transpiled (types stripped, nothing checked)
// with the `typescript` module first.
//
// Protocol: one JSON command per line on stdin. After each command the
// kernel writes TOKEN plus a status (0, or 1 for an error) on stdout, then,
// for a cell, a space and its result or error as one line of JSON, then a
// newline; and TOKEN on stderr, so the reader knows both streams are
// drained. (No result file: the server and the kernel run as different
// users and share no directory.)
// `console.log` and friends write to stdout and stderr unchanged.

import repl from 'node:repl'
import { PassThrough } from 'node:stream'
import { createRequire } from 'node:module'
import readline from 'node:readline'
import util from 'node:util'

const token = process.env.COPSE_KERNEL_TOKEN
delete process.env.COPSE_KERNEL_TOKEN
const typescript = process.argv.includes('--typescript')

const server = repl.start({
  input: new PassThrough(),
  output: new PassThrough(),
  terminal: false,
  prompt: '',
  useGlobal: true,
  breakEvalOnSigint: true,
  ignoreUndefined: true,
})

// The REPL reports a cell's uncaught error to its domain, not to the
// evaluation's callback.
let settle = null
server._domain.on('error', (error) => finish(error))

function finish(error, value) {
  const done = settle
  settle = null
  if (done) done(error, value)
}

function evaluate(code) {
  return new Promise((resolve) => {
    settle = (error, value) => resolve({ error, value })
    // Synchronous code is stopped by the REPL's own SIGINT watchdog, which
    // works only while no SIGINT listener is installed.
    server.eval(code, server.context, 'cell', (error, value) => finish(error, value))
    if (!settle) return
    // Still awaiting: an interrupt ends the cell, abandoning what it awaits.
    const interrupted = () => finish(Object.assign(new Error('Execution interrupted'), { name: 'KeyboardInterrupt' }))
    process.once('SIGINT', interrupted)
    const done = settle
    settle = (error, value) => {
      process.removeListener('SIGINT', interrupted)
      done(error, value)
    }
  })
}

let transpiler = null
function transpile(code) {
  if (!transpiler) {
    const require = createRequire(import.meta.url)
    transpiler = require('typescript')
  }
  return transpiler.transpileModule(code, {
    compilerOptions: { target: transpiler.ScriptTarget.ES2022, module: transpiler.ModuleKind.None },
    reportDiagnostics: false,
  }).outputText
}

// Node's frames below the cell's own say nothing to its author.
function traceback(error) {
  const lines = String(error.stack || error).split('\n')
  const internal = lines.findIndex((l) => /\(node:|at (ContextifyScript|REPLServer|bound) /.test(l))
  return (internal > 0 ? lines.slice(0, internal) : lines).join('\n')
}

// As a Jupyter kernel's text/plain: strings quoted (the server unquotes
// them as it does Python's).
function display(value) {
  return { 'text/plain': util.inspect(value, { depth: 4, colors: false }) }
}

const saved = []

async function run(command) {
  switch (command.op) {
    case 'run': {
      let code = command.code
      if (typescript) {
        try {
          code = transpile(code)
        } catch (error) {
          return report({ error: { name: 'TypeScriptError', value: String(error.message || error), traceback: '' } })
        }
      }
      const { error, value } = await evaluate(code)
      if (error) {
        const name = (error && error.name) || 'Error'
        const message = error && error.message !== undefined ? String(error.message) : String(error)
        return report({ error: { name, value: message, traceback: traceback(error) } })
      }
      return report(value === undefined ? {} : { result: display(value) })
    }
    case 'env':
      Object.assign(process.env, command.envs)
      return 0
    case 'push_env':
      saved.push(Object.fromEntries(Object.keys(command.envs).map((k) => [k, process.env[k]])))
      Object.assign(process.env, command.envs)
      return 0
    case 'pop_env':
      for (const [k, v] of Object.entries(saved.pop() || {})) {
        if (v === undefined) delete process.env[k]
        else process.env[k] = v
      }
      return 0
    default:
      return report({ error: { name: 'KernelError', value: `unknown command ${command.op}`, traceback: '' } })
  }
}

// The outcome of the command being run, sent after its status.
let outcome = null

function report(result) {
  outcome = result
  return result.error ? 1 : 0
}

const lines = readline.createInterface({ input: process.stdin, terminal: false })
for await (const line of lines) {
  let status
  outcome = null
  try {
    status = await run(JSON.parse(line))
  } catch (error) {
    status = report({ error: { name: 'KernelError', value: String(error), traceback: '' } })
  }
  // JSON.stringify escapes every newline, so the outcome is one line.
  const payload = outcome === null ? '' : ` ${JSON.stringify(outcome)}`
  process.stdout.write(`${token}${status}${payload}\n`)
  process.stderr.write(token)
}
process.exit(0)
