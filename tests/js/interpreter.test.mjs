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
