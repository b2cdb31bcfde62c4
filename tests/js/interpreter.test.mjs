import { test } from 'node:test'
import assert from 'node:assert/strict'
import { Sandbox } from '@e2b/code-interpreter'
import { sandbox } from './helpers.mjs'

test('runCode keeps state, streams output, reports errors, runs bash', async () => {
  const sbx = await sandbox({}, Sandbox)
  await sbx.runCode('x = 41')
  const stdout = []
  const result = await sbx.runCode('print("streamed"); x + 1', { onStdout: (m) => stdout.push(m.line) })
  assert.equal(result.text, '42')
  assert.deepEqual(result.logs.stdout, ['streamed\n'])
  assert.deepEqual(stdout, ['streamed\n'])

  const failed = await sbx.runCode('1 / 0')
  assert.equal(failed.error.name, 'ZeroDivisionError')

  const ctx = await sbx.createCodeContext({ cwd: '/tmp' })
  assert.equal((await sbx.runCode('import os; os.getcwd()', { context: ctx })).text, '/tmp')
  const bash = await sbx.runCode('echo from bash', { language: 'bash' })
  assert.deepEqual(bash.logs.stdout, ['from bash\n'])
})

test('JavaScript and TypeScript contexts run like a node prompt', async () => {
  const sbx = await sandbox({}, Sandbox)
  const js = (code, opts = {}) => sbx.runCode(code, { language: 'js', ...opts })
  assert.equal((await js('const base = 41; base + 1')).text, '42')
  assert.equal((await js('base + 2')).text, '43', 'declarations persist between cells')

  const out = []
  const streamed = await js('console.log("to stdout"); console.error("to stderr"); "done"',
    { onStdout: (m) => out.push(m.line) })
  assert.deepEqual(streamed.logs.stdout, ['to stdout\n'])
  assert.deepEqual(streamed.logs.stderr, ['to stderr\n'])
  assert.deepEqual(out, ['to stdout\n'])
  assert.equal(streamed.text, 'done')

  const awaited = await js('const os = require("node:os"); await new Promise((r) => setTimeout(r, 50)); os.platform()')
  assert.equal(awaited.text, 'linux')
  assert.equal((await js('process.env.ONLY_THIS_CALL', { envs: { ONLY_THIS_CALL: 'set' } })).text, 'set')
  assert.equal((await js('process.env.ONLY_THIS_CALL')).text, undefined)

  const failed = await js('null.property')
  assert.equal(failed.error.name, 'TypeError')
  assert.match(failed.error.traceback, /TypeError/)
  assert.doesNotMatch(failed.error.traceback, /node:/, 'Node internals in the traceback')
  assert.equal((await js('base')).text, '41', 'an error leaves the context usable')

  // A package installed in the sandbox (as `npm install` would leave it),
  // through require and import.
  await sbx.files.write('/home/user/node_modules/greeter/package.json', '{"name": "greeter", "main": "index.js"}')
  await sbx.files.write('/home/user/node_modules/greeter/index.js', 'module.exports = (n) => `hello ${n}`')
  assert.equal((await js('require("greeter")("require")')).text, 'hello require')
  assert.equal((await js('const { default: greet } = await import("greeter"); greet("import")')).text, 'hello import')

  const ts = (code) => sbx.runCode(code, { language: 'ts' })
  assert.equal((await ts('interface Point { x: number }\nconst p: Point = { x: 3 }\np.x * 2')).text, '6')
  assert.equal((await ts('const label: string = `p is ${JSON.stringify(p)}`; label')).text, 'p is {"x":3}')

  const timed = await js('while (true) {}', { timeoutMs: 2_000 }).catch((e) => e)
  assert.ok(timed instanceof Error, 'an endless cell should time out')
  assert.equal((await js('base * 2')).text, '82', 'the context survives an interrupted cell')
})
